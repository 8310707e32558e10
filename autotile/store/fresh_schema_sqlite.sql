CREATE TABLE autotile_alembic_version (
	version_num VARCHAR(32) NOT NULL, 
	CONSTRAINT autotile_alembic_version_pkc PRIMARY KEY (version_num)
);
CREATE TABLE autotile_meta (
	"key" VARCHAR(64) NOT NULL, 
	value VARCHAR(256) NOT NULL, 
	PRIMARY KEY ("key")
);
CREATE TABLE autotile_devices (
	id INTEGER NOT NULL, 
	fingerprint VARCHAR(64) NOT NULL, 
	"key" VARCHAR(64) NOT NULL, 
	profile VARCHAR(64) NOT NULL, 
	name VARCHAR(128) NOT NULL, 
	compute_capability VARCHAR(16) NOT NULL, 
	sm_count INTEGER NOT NULL, 
	memory_bytes BIGINT NOT NULL, 
	smem_per_block INTEGER NOT NULL, 
	driver VARCHAR(64) NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_device_fingerprint UNIQUE (fingerprint)
);
CREATE TABLE autotile_toolchains (
	id INTEGER NOT NULL, 
	torch VARCHAR(64) NOT NULL, 
	triton VARCHAR(64) NOT NULL, 
	cuda VARCHAR(64) NOT NULL, 
	python VARCHAR(32) NOT NULL, 
	autotile VARCHAR(32) NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_toolchain UNIQUE (torch, triton, cuda, python, autotile)
);
CREATE TABLE autotile_problems (
	id INTEGER NOT NULL, 
	family VARCHAR(32) NOT NULL, 
	"key" TEXT NOT NULL, 
	bucket TEXT NOT NULL, 
	params JSON NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_problem UNIQUE (family, "key")
);
CREATE TABLE autotile_trials (
	id INTEGER NOT NULL, 
	problem_id INTEGER NOT NULL, 
	device_id INTEGER NOT NULL, 
	toolchain_id INTEGER NOT NULL, 
	study VARCHAR(200) NOT NULL, 
	number INTEGER NOT NULL, 
	config TEXT NOT NULL, 
	config_hash VARCHAR(32) NOT NULL, 
	status VARCHAR(32) NOT NULL, 
	median_ms FLOAT, 
	q20_ms FLOAT, 
	q80_ms FLOAT, 
	interpreted INTEGER NOT NULL, 
	max_abs_error FLOAT, 
	error TEXT NOT NULL, 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_trial_in_study UNIQUE (study, number), 
	FOREIGN KEY(problem_id) REFERENCES autotile_problems (id), 
	FOREIGN KEY(device_id) REFERENCES autotile_devices (id), 
	FOREIGN KEY(toolchain_id) REFERENCES autotile_toolchains (id)
);
CREATE TABLE autotile_winners (
	id INTEGER NOT NULL, 
	problem_id INTEGER NOT NULL, 
	device_key VARCHAR(64) NOT NULL, 
	device_id INTEGER NOT NULL, 
	toolchain_id INTEGER NOT NULL, 
	config TEXT NOT NULL, 
	config_hash VARCHAR(32) NOT NULL, 
	median_ms FLOAT NOT NULL, 
	q20_ms FLOAT NOT NULL, 
	q80_ms FLOAT NOT NULL, 
	interpreted INTEGER NOT NULL, 
	runner_up_ms FLOAT, 
	margin FLOAT, 
	baseline_name VARCHAR(128) NOT NULL, 
	baseline_ms FLOAT, 
	trials_run INTEGER NOT NULL, 
	provenance TEXT NOT NULL, 
	created_at DATETIME NOT NULL, stale INTEGER DEFAULT '0' NOT NULL, verified_at DATETIME, verified_ms FLOAT, verify_status VARCHAR(32) DEFAULT '' NOT NULL, regression FLOAT, verified_range JSON, kernel_config TEXT, kernel_ms FLOAT, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_winner UNIQUE (problem_id, device_key), 
	FOREIGN KEY(problem_id) REFERENCES autotile_problems (id), 
	FOREIGN KEY(device_id) REFERENCES autotile_devices (id), 
	FOREIGN KEY(toolchain_id) REFERENCES autotile_toolchains (id)
);
CREATE TABLE autotile_policies (
	id INTEGER NOT NULL, 
	family VARCHAR(32) NOT NULL, 
	device_key VARCHAR(64) NOT NULL, 
	device_id INTEGER NOT NULL, 
	toolchain_id INTEGER NOT NULL, 
	"key" TEXT NOT NULL, 
	range_key VARCHAR(256) NOT NULL, 
	params JSON NOT NULL, 
	verified_range JSON NOT NULL, 
	config TEXT NOT NULL, 
	samples INTEGER NOT NULL, 
	min_ratio FLOAT NOT NULL, 
	geomean_ratio FLOAT NOT NULL, 
	provenance TEXT DEFAULT '' NOT NULL, 
	created_at DATETIME, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_policy UNIQUE (family, device_key, "key", range_key), 
	FOREIGN KEY(device_id) REFERENCES autotile_devices (id), 
	FOREIGN KEY(toolchain_id) REFERENCES autotile_toolchains (id)
);
CREATE INDEX ix_autotile_devices_key ON autotile_devices ("key");
CREATE INDEX ix_autotile_policies_device_key ON autotile_policies (device_key);
CREATE INDEX ix_autotile_policies_family ON autotile_policies (family);
CREATE INDEX ix_autotile_problems_family ON autotile_problems (family);
CREATE INDEX ix_autotile_trials_config_hash ON autotile_trials (config_hash);
CREATE INDEX ix_autotile_trials_problem_id ON autotile_trials (problem_id);
CREATE INDEX ix_autotile_winners_device_key ON autotile_winners (device_key);
CREATE INDEX ix_autotile_winners_problem_id ON autotile_winners (problem_id);
INSERT INTO autotile_meta VALUES ('created_by', 'autotile');
INSERT INTO autotile_meta VALUES ('schema_version', '3');
INSERT INTO autotile_alembic_version VALUES ('0003');
