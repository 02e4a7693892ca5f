# Shared by the recipe launchers (sourced from the repository root).
# prepare_prompts DATASET RAW_TRAIN RAW_TEST OUT_DIR: convert the public files (a file, or a folder of them)
# into OUT_DIR/train.jsonl and OUT_DIR/test.jsonl with scripts/preprocess/DATASET.py, once.
# prepare_math: the MATH recipes' prompts in data/math from MATH_DIR (or MATH_TRAIN) and MATH_TEST.
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}

prepare_prompts() {
  local dataset=$1 raw_train=$2 raw_test=$3 out=$4
  for split in train test; do
    local raw=$raw_train
    [ "$split" = test ] && raw=$raw_test
    if [ ! -s "$out/$split.jsonl" ]; then
      [ -e "$raw" ] || { echo "recipe: $dataset $split input not found: $raw" >&2; exit 1; }
      "$PYTHON" "scripts/preprocess/$dataset.py" "$raw" --output "$out/$split.jsonl" ${SKIP_MALFORMED:+--skip-malformed}
    fi
  done
}

prepare_math() {
  prepare_prompts math "${MATH_TRAIN:-${MATH_DIR:?set MATH_DIR to the MATH release folder (train/<subject>/*.json)}/train}" \
    "${MATH_TEST:?set MATH_TEST to MATH-500 test.jsonl (or a MATH test folder)}" data/math
}
