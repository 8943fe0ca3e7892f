# Sourced by the GPU scripts: installs nngeometry (KFAC/EKFAC) from a wheel carried in
# .whl/ into /tmp/site (once a machine) and puts /tmp/site and the repository root ($1)
# on PYTHONPATH. The GPU machine has no network: `pip download --no-deps
# nngeometry==0.4 -d .whl` here first. Needs PY (the Python to install with).
nngeometry_site() {
  if ls .whl/nngeometry-*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/nngeometry ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/nngeometry-*.whl 2>&1 | tail -1
  fi
  export PYTHONPATH="/tmp/site:$1${PYTHONPATH:+:$PYTHONPATH}"
}
