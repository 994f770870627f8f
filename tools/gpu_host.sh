#!/usr/bin/env bash
# What a GPU host runs: the carried wheels installed into a folder of their own (nothing of the
# image is replaced), the packages checked, then `make gpu-check`; the executed notebooks are
# packed next to the report.
#
#   bash tools/gpu_host.sh OUT [DEADLINE_MINUTES]        # e.g. bash tools/gpu_host.sh "$OUT" 9
#
# PYTHON (default python3) is the host's interpreter; SITE (default /tmp/course-site) is where
# the wheels from .whl/ (make gpu-wheels) go. Rehearsed on a CPU by `make gpu-rehearsal`.
set -uo pipefail
out=${1:?usage: bash tools/gpu_host.sh OUT [DEADLINE_MINUTES]}
deadline=${2:-9}
py=${PYTHON:-python3}
site=${SITE:-/tmp/course-site}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
wheels=$(ls .whl/core/*.whl .whl/extras/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  echo "installing $(echo "$wheels" | wc -l) carried wheels into $site"
  # shellcheck disable=SC2086
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" $wheels || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no wheels in .whl/: the notebooks need nbclient and ipykernel (make gpu-wheels)"
fi
export PATH="$site/bin:$PATH"  # console scripts of the carried packages
# Installed without byte-compiling (faster), so a carried package's source is compiled at its
# first import; its invalid escapes' SyntaxWarnings would then fill the log.
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore::SyntaxWarning"
if command -v make >/dev/null; then  # make checks the packages first (python -m helpers doctor)
  make --no-print-directory gpu-check PYTHON="$py" GPU_CHECK_OUT="$out" GPU_CHECK_DEADLINE="$deadline"
else
  export PYTHONPATH="$PWD:$PYTHONPATH"
  "$py" -m helpers doctor && "$py" -m helpers gpu-check --out "$out" --deadline "$deadline"
fi
status=$?
if [ -d build/gpu-check/executed ]; then
  tar czf "$out/executed-notebooks.tar.gz" -C build/gpu-check executed
fi
exit $status
