#!/usr/bin/env bash
# Build a venv with a given set of releases and run hf_tp's unit suite there.
#
#   scripts/compat.sh floor                          # the floors of hf_tp/compat/releases.py (what CI runs)
#   scripts/compat.sh transformers==5.17.0 accelerate==1.10.0 ...
#   scripts/compat.sh next                           # the newest releases the registry holds, past the ceilings
#   COMPAT_VENV=/tmp/v COMPAT_PYTEST="-x -k grid" scripts/compat.sh floor
#
# `next` (run by hand, not in CI) installs the newest torch, transformers, accelerate, datasets, peft
# and trl the package registry offers, past pyproject.toml's upper bounds (COMPAT_NEXT_KEEP_TORCH=1
# keeps the CPU wheel: a newer torch is a CUDA build of several GB), runs the unit suite (the family,
# MoE and wrapper grids are in it) and prints one line per failing test and a row for
# docs/compatibility.md's table of "next" tries.
#
# torch is the CPU wheel 2.13.0 unless a torch==X is given (older torch wheels are CUDA builds).
# The venv (COMPAT_VENV, default /tmp/hf_tp-compat-<versions>) is reused when it already holds
# exactly these releases; COMPAT_FROM_VENV=DIR builds it from a copy of the venv DIR (faster).
# Prints the releases installed, then pytest's summary; exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${COMPAT_PYTHON:-python3.11}

if [ "${1:-}" = next ]; then
    venv=${COMPAT_VENV:-/tmp/hf_tp-compat-next}
    rm -rf "$venv"
    no_compile=$([ -z "${PYTHONDONTWRITEBYTECODE:-}" ] && echo --no-compile || true)
    if [ -n "${COMPAT_FROM_VENV:-}" ]; then cp -a "$COMPAT_FROM_VENV" "$venv"; else
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
        "$venv/bin/python" -m pip install -q $no_compile torch==2.13.0
        "$venv/bin/python" -m pip install -q $no_compile -e ".[test]" torch==2.13.0
    fi
    newest=(transformers accelerate datasets peft trl)
    [ -n "${COMPAT_NEXT_KEEP_TORCH:-}" ] || newest=(torch "${newest[@]}")
    # pip warns that hf_tp's upper bounds are not met: that is the point of this run
    "$venv/bin/python" -m pip install -q $no_compile --upgrade "${newest[@]}" 2>&1 | grep -v "^WARNING: Location" || true
    releases=$("$venv/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|datasets|peft|trl) ' \
        | awk '{printf "%s%s %s", sep, $1, $2; sep=", "}')
    echo "releases: $releases"
    log=$(mktemp)
    eval "extra=(${COMPAT_PYTEST:-})"
    set +e
    # (past the ceilings by design: the test that holds the installed releases to them is left out)
    OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 -rfE --tb=no "${extra[@]}" tests/unit \
        --deselect tests/unit/test_compat.py::test_the_installed_releases_are_not_newer_than_tested >"$log" 2>&1
    status=$?
    set -e
    # one line per failure: the test (its family in brackets) and the first line of its error
    grep -E '^(FAILED|ERROR) ' "$log" | sed -E 's/^(FAILED|ERROR) tests\/unit\///' | cut -c1-240 || true
    summary=$(tail -n 1 "$log" | sed -E 's/=//g; s/^ +| +$//g')
    echo "summary: $summary"
    failed=$(grep -E '^(FAILED|ERROR) ' "$log" | sed -E 's/^(FAILED|ERROR) tests\/unit\///; s/ - .*//' | paste -sd ';' | sed 's/;/; /g')
    echo "row: | $(date +%F) | $releases | $summary | ${failed:-none} |"
    exit $status
fi

specs=()
for arg in "$@"; do
    if [ "$arg" = floor ]; then
        # hf_tp/compat/releases.py's FLOORS and PEFT_FLOOR, read without importing hf_tp (no packages needed)
        mapfile -t floors < <("$python" - <<'EOF'
import ast
tree = ast.parse(open("hf_tp/compat/releases.py").read())
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
