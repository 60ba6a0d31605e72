#!/usr/bin/env bash
# Build a venv with a given set of releases and run hf_tp's unit suite there.
#
#   scripts/compat.sh floor                          # the floors of hf_tp/compat.py (what CI runs)
#   scripts/compat.sh transformers==5.17.0 accelerate==1.10.0 ...
#   COMPAT_VENV=/tmp/v COMPAT_PYTEST="-x -k grid" scripts/compat.sh floor
#
# torch is the CPU wheel 2.13.0 unless a torch==X is given (older torch wheels are CUDA builds).
# The venv (COMPAT_VENV, default /tmp/hf_tp-compat-<versions>) is reused when it already holds
# exactly these releases; COMPAT_FROM_VENV=DIR builds it from a copy of the venv DIR (faster).
# Prints the releases installed, then pytest's summary; exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${COMPAT_PYTHON:-python3.11}

specs=()
for arg in "$@"; do
    if [ "$arg" = floor ]; then
        # hf_tp/compat.py's FLOORS and PEFT_FLOOR, read without importing hf_tp (no packages needed)
        mapfile -t floors < <("$python" - <<'EOF'
import ast
tree = ast.parse(open("hf_tp/compat.py").read())
for node in tree.body:
    if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "FLOORS":
        for k, v in ast.literal_eval(node.value).items():
            print(f"{k}=={v}")
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PEFT_FLOOR":
        print(f"peft=={ast.literal_eval(node.value)}")
EOF
        )
        specs+=("${floors[@]}")
    else
        specs+=("$arg")
    fi
done
[ ${#specs[@]} -gt 0 ] || { echo "usage: scripts/compat.sh floor | PACKAGE==VERSION ..." >&2; exit 2; }
printf '%s\n' "${specs[@]}" | grep -q '^torch==' || specs+=("torch==2.13.0")
torch_spec=$(printf '%s\n' "${specs[@]}" | grep '^torch==')

venv=${COMPAT_VENV:-/tmp/hf_tp-compat-$(printf '%s_' "${specs[@]}" | tr -c 'A-Za-z0-9._\n' '_')}
stamp="$venv/.hf_tp-compat"
# pip compiles every file it installs unless Python caches bytecode itself on first import
no_compile=$([ -z "${PYTHONDONTWRITEBYTECODE:-}" ] && echo --no-compile || true)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${specs[*]}" ]; then
    rm -rf "$venv"
    if [ -n "${COMPAT_FROM_VENV:-}" ]; then
        # A copy of an installed venv (CI's, with this torch wheel): pip then only swaps the pinned
        # packages for the releases asked, instead of unpacking torch and the test tools again.
        # Its old entry-point scripts keep the source venv's shebang, hence `python -m` below.
        cp -a "$COMPAT_FROM_VENV" "$venv"
    else
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
        "$venv/bin/python" -m pip install -q $no_compile "$torch_spec"  # first alone: otherwise pip may pick a CUDA build
    fi
    "$venv/bin/python" -m pip install -q $no_compile -e ".[test]" "${specs[@]}"
    echo "${specs[*]}" >"$stamp"
fi
"$venv/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|datasets|peft|huggingface.hub|safetensors) '
eval "extra=(${COMPAT_PYTEST:-})"  # pytest flags, split as a shell would (quotes kept together)
OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 "${extra[@]}" tests/unit
