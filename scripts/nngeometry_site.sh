# Sourced by the GPU scripts: installs the wheels carried in .whl/ into /tmp/site (once a
# machine) and puts /tmp/site and the repository root ($1) on PYTHONPATH: nngeometry
# (KFAC/EKFAC) and pytorch-optimizer (SOAP and Shampoo of the Fig. 3 study). The GPU
# machine has no network: `pip download --no-deps nngeometry==0.4 pytorch-optimizer==4.1.0
# -d .whl` here first (the versions of requirements-nodeps.txt and requirements.txt).
# Needs PY (the Python to install with).
nngeometry_site() {
  local pkg
  for pkg in nngeometry pytorch_optimizer; do
    if ls .whl/$pkg-*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/$pkg ]; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/$pkg-*.whl 2>&1 | tail -1
    fi
  done
  export PYTHONPATH="/tmp/site:$1${PYTHONPATH:+:$PYTHONPATH}"
}
