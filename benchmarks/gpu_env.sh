# Sourced by the GPU scripts (run_gpu.sh, decode_tables.sh) from the repository root on the GPU machine: Python
# packages the machine lacks travel as wheels in .whl/ (shared/device/wheels.sh) and are installed to /tmp/site;
# the repository goes on PYTHONPATH after whatever the caller put there.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
fi
export PYTHONUNBUFFERED=1
