#!/usr/bin/env bash
# A newcomer's first day, as issue 52 tried it: a clean clone of this checkout's HEAD, `make demo`, the demo run's
# summary as JSON, `trainyard check` of a DAG folder holding a bad file name and a duplicate pipeline id beside the
# good spec (exit 1, both named, the good DAG still listed by Airflow), and a screenshot of the demo's report.
# Slow (a venv, then the demo: minutes) and not part of `make test`, whose tests cover each piece; run it by hand
# (`make newcomer`) before saying the first day works. Usage: tools/newcomer.sh [WORK_DIR] (default: a temp folder).
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
clone="$work/trainyard"
rm -rf "$clone"
git clone -q "$src" "$clone"
cd "$clone"
say() { printf '\n== %s\n' "$*"; }

say "make demo"
start=$SECONDS
make demo
echo "make demo took $((SECONDS - start)) s"

# The Makefile's environment, for the commands a newcomer types next (as docs/getting-started says).
export TRAINYARD_HOME="$clone/.trainyard" AIRFLOW_HOME="$clone/.airflow" AIRFLOW__CORE__DAGS_FOLDER="$clone/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$clone/plugins" AIRFLOW__CORE__LOAD_EXAMPLES=False PATH="$clone/.venv/bin:$PATH"

say "trainyard summary --dag-id nightly_pretrain -o json"
trainyard summary --dag-id nightly_pretrain -o json > "$work/summary.json"
python - "$work/summary.json" <<'PY'
import json, sys
summary = json.load(open(sys.argv[1]))
assert summary["state"] == "succeeded", summary["state"]
print(f"state {summary['state']}, steps trained {summary['steps_trained']}, report {summary.get('report')}")
PY

say "trainyard check dags/pipelines with 'my pipeline.yaml' and a duplicate id beside the good spec"
cp dags/pipelines/nightly_pretrain.yaml "dags/pipelines/my pipeline.yaml"
# A second spec naming the good one's DAG id (without `pipeline:`, the id is the file name's).
{ echo "pipeline: nightly_pretrain"; cat dags/pipelines/nightly_pretrain.yaml; } > dags/pipelines/nightly_copy.yaml
set +e
trainyard check dags/pipelines > "$work/check.txt" 2>&1
rc=$?
set -e
cat "$work/check.txt"
[ "$rc" = 1 ] || { echo "check exited $rc, not 1"; exit 1; }
grep -q "my pipeline.yaml" "$work/check.txt" || { echo "check did not name 'my pipeline.yaml'"; exit 1; }
grep -q "nightly_copy.yaml" "$work/check.txt" || { echo "check did not name nightly_copy.yaml"; exit 1; }
airflow dags reserialize > /dev/null 2>&1 || true
airflow dags list -o plain > "$work/dags.txt" 2>/dev/null
grep -q "nightly_pretrain" "$work/dags.txt" || { cat "$work/dags.txt"; echo "the good DAG is gone"; exit 1; }
echo "airflow dags list still lists nightly_pretrain"
airflow dags list-import-errors -o plain 2>/dev/null > "$work/import-errors.txt" || true  # exits 1 when there are some
grep -c "my pipeline.yaml\|nightly_copy.yaml" "$work/import-errors.txt" | xargs echo "import error lines naming the bad files:"
rm "dags/pipelines/my pipeline.yaml" dags/pipelines/nightly_copy.yaml

say "the demo's report in headless Chromium"
report=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['report'])" "$work/summary.json")
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,3000 \
  --screenshot="$work/report.png" "file://$report" > /dev/null 2>&1
ls -l "$work/report.png"
echo "newcomer path: ok (artifacts in $work)"
