#!/usr/bin/env bash
# One GPU session: the GPU test suite, then the measurements the book plots, recorded with
# provenance into results/<device>/ and packed into $OUT/results.tgz. Run from the repository root
# of a committed tree:  MOE_KERNELS_COMMIT=<full hash> bash tools/gpu_check.sh [what...]
# Write the hash out here, where the tree was committed: on the device, git's metadata can be an older
# tree's than the files it was sent (git rev-parse HEAD there named the session's first commit).
# what: tests, unmarked (the unmarked tests of the kernel files, compiled: UNMARKED_FILES, UNMARKED_TIMEOUT_S),
# fp8-permute-tests and fp8-permute-ab (session 27's fp8 permute candidates: their GPU tests, then their A/Bs, a call
# each; session 28's half tiles among them), decode-transposed-tests and decode-transposed-ab (the transposed
# Gluon kernel's tests, then its A/B: a call each), first-run (sessions 27-29's kernels in one call: their tests,
# the decode A/B on Qwen3, the prefill A/B on DeepSeek-V3), half-tiles (session 30's half tiles on one program a
# tile: their tests, the prefill GEMMs' A/B, the routed layer), decode-stages (decode's stages alone on both
# paths), s30 (session 30 in one call: the half-tile tests, DeepSeek-V3's prefill GEMMs and layer, Qwen3's
# decode stages), s30-layer, s30-defaults (the new defaults' GPU tests, the layer with "auto"), tma-store (GEMM 2's
# TMA-store epilogue: its tests and the GEMMs' A/B), s31 (the layer with "auto" and GEMM 2 on half tiles, the
# fixed unmarked tests, bench fp8), transposed-prefill (the transposed kernel's 64-row tiles at prefill), shared-fused
# (DeepSeek-V3's shared expert fused as slot E: its fp8 tables tuned at decode, then the layer with it separate,
# fused and left out), bf16-prefill (the routed bf16 layer on the bf16 Gluon GEMMs against the other layouts, then the
# GEMMs alone against the Triton kernel and balanced bmm), bf16-balanced (the bf16 GEMMs alone on real and balanced
# routing, the walk's group, two programs an SM; the L2's read rate; the router's steps at DeepSeek-V3 512 tokens),
# bf16-one-pass (the routed bf16 layer with its input scattered in one pass: tests, then the layer A/B), ceilings,
# tune, refine, sweep, fp8, decode-step, layouts, routing, skew, shared, capacity, notebooks,
# graphs (the CUDA-graph replay's and the split GEMM 1's GPU tests), assert-tests (the index-gather and CUDA-graph
# GPU tests, the device-side id asserts among them), host-probe, model-probe, prefill, gate-routing
# (the router in one launch and in launches chained by PDL, with and without the alignment: their GPU tests and bench routing --gate-routing),
# tune-shared (the shared expert's tiles, bf16 and fp8, tables written), id-check (bench layer --id-check-only, ID_CHECK_PAIRS pairs at ID_CHECK_BATCHES,
# recorded as ID_CHECK_NAME or layer-id-check), id-check-gemm1 (the check's cost in GEMM 1 and in GEMM 2 against none,
# naive block map; ID_CHECK_GEMM1_ARGS: the tool's arguments), one-launch (both GEMMs in one launch against two), launch-floor (what one more
# kernel in a CUDA graph costs), l2-flush (short calls under do_bench's flush, a clean one and inside a graph),
# fp8-flushes (bench fp8 at decode under each flush), layer (bench layer at LAYER_BATCHES as LAYER_NAME, after the layer-path GPU tests), tile-read (the GEMMs' weight-tile pattern read alone; TILE_READ_ARGS: models formats), model (bench model at
# MODEL_BATCHES, MODEL_ROUNDS eager rounds of MODEL_STEPS steps, recorded as MODEL_NAME or model-step; MODEL_ARGS: more of its arguments; 1,8,64 took 170 s at fb84557) (default: tests
# ceilings sweep). NOTEBOOKS="06 07" limits the notebooks step to those sections. tune searches the tiles (TUNE_BATCHES, TUNE_BUDGET_S) and rewrites the tuned tables in
# moe_kernels/kernels/configs/, which are packed too. notebooks executes every notebook with the GPU (its live cells run) into $OUT/notebooks
# and lists the prose numbers that would change (needs Jupyter: run tools/jupyter_wheels.sh here and carry .whl/jupyter).
set -uo pipefail
export PYTHONUNBUFFERED=1
: "${MOE_KERNELS_COMMIT:?set MOE_KERNELS_COMMIT to the hash of the committed tree being measured}"
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
steps=("$@")
# The first GPU runs of new kernels: their tests compile dozens of variants, so spread them over 8 processes (the
# device image has pytest-xdist) with a per-test limit (pytest-timeout), which turns a hang into one failure.
PARALLEL=${PARALLEL--n 8 --timeout 120}
[ ${#steps[@]} -eq 0 ] && steps=(tests ceilings sweep)
status=0
for step in "${steps[@]}"; do
    echo "=== $step ($(date -u +%H:%M:%S))"
    case "$step" in
        tests) $PY -m pytest tests -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 25 || status=1 ;;
        sweep) $PY -m moe_kernels.bench sweep --warmup-ms 5 --rep-ms 30 --record \
                   2>&1 | tee "$OUT/sweep.log" | grep -E "GEMMs graph|bmm|ceilings|recorded" || status=1 ;;
        tune) $PY -m moe_kernels.bench tune --batches "${TUNE_BATCHES:-1,8,64,512,2048,4096,16384,256,1024,16,32,128,2,4,8192}" \
                  --warmup-ms 2 --rep-ms 10 --budget-s "${TUNE_BUDGET_S:-400}" --workers "$(nproc)" --record --write-tables \
                  2>&1 | tee "$OUT/tune.log" | grep -E "batch|wrote|recorded|precompiled|budget" || status=1 ;;
        refine) for format in none block; do   # today's tiles with TMA, grids, swap_ab and PDL; tables rewritten
                    $PY -m moe_kernels.bench tune --refine --format $format --batches "${TUNE_BATCHES:-1,8,64,512}" \
                        --warmup-ms 2 --rep-ms 10 --workers "$(nproc)" --record --write-tables \
                        2>&1 | tee "$OUT/refine-$format.log" | grep -E "batch|wrote|recorded|precompiled" || status=1
                done ;;
        tune-shared) # DeepSeek-V3's shared expert on its dense block map; E=1 tables. bf16 runs it there up to
                     # 16 tokens (cuBLAS above: layer.DENSE_SHARED_MAX_TOKENS), fp8 at every batch.
                     for format in none block; do
                         batches=${SHARED_BATCHES:-1,2,4,8,16}
                         [ "$format" = block ] && batches=${SHARED_FP8_BATCHES:-1,2,4,8,16,32,64,128}
                         $PY -m moe_kernels.bench tune --shared --models deepseek-v3 --format $format --batches "$batches" \
                             --warmup-ms 2 --rep-ms 10 --budget-s "${SHARED_BUDGET_S:-200}" --workers "$(nproc)" \
                             --record --write-tables 2>&1 | tee "$OUT/tune-shared-$format.log" \
                             | grep -E "batch|wrote|recorded|precompiled|budget" || status=1
                     done ;;
        fp8) $PY -m moe_kernels.bench fp8 --record 2>&1 | tee "$OUT/fp8.log" | grep -E "GEMMs|permute|scaled|recorded|TB/s" \
                 | grep -E " (1|8|64|512|4096|16384) |recorded|TB/s" || status=1 ;;
        notebooks) mkdir -p "$OUT/notebooks"
                   # Jupyter from the wheels tools/jupyter_wheels.sh downloaded (carry .whl/jupyter)
                   if ! $PY -c "import nbclient, ipykernel, ipywidgets, matplotlib" 2>/dev/null && [ -d .whl/jupyter ]; then
                       $PY -m pip install -q --no-index --find-links .whl/jupyter nbclient nbformat ipykernel \
                           jupyter_client ipywidgets matplotlib 2>&1 | tail -n 3
                   fi
                   $PY -m ipykernel install --user --name python3 >/dev/null 2>&1 || true   # the kernel the runs ask for
                   # (the kernel starts in notebooks/: a relative PYTHONPATH would not find the package)
                   for nb in notebooks/*.ipynb; do
                       if [ -n "${NOTEBOOKS:-}" ] && ! [[ " $NOTEBOOKS " == *" $(basename "$nb" | cut -c1-2) "* ]]; then
                           continue
                       fi
                       PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" $PY tools/execute_notebooks.py --check \
                           --out "$OUT/notebooks" "$nb" 2>&1 | grep -v "running over TCP" | tee -a "$OUT/notebooks.log" || status=1
                       # one archive (the device tool brings back only a few files one by one), rewritten
                       # after each notebook: a call cut by its time limit keeps the ones that ran
                       # (written aside, then moved: a call killed mid-tar keeps the last whole archive)
                       if [ -d "$OUT/notebooks" ]; then
                           tar czf "$OUT/notebooks.tgz.tmp" -C "$OUT" notebooks \
                               && mv -f "$OUT/notebooks.tgz.tmp" "$OUT/notebooks.tgz" || status=1
                       fi
                   done
                   [ -s "$OUT/notebooks.tgz" ] && rm -r "$OUT/notebooks" ;;
        decode-step) $PY -m moe_kernels.bench decode-step --fp8 --record 2>&1 | tee "$OUT/decode-step.log" | tail -n 14 || status=1 ;;
        graphs) $PY -m pytest tests/test_replay.py tests/test_gemm_variants.py -m gpu -q -p no:cacheprovider \
                    -W ignore::DeprecationWarning -k "graph or split or captures or replays" 2>&1 \
                    | tee "$OUT/graph-tests.log" | tail -n 15 || status=1 ;;
        assert-tests) $PY -m pytest tests/test_index_gather.py tests/test_cuda_graphs.py -m gpu -q -p no:cacheprovider \
                          -W ignore::DeprecationWarning 2>&1 | tee "$OUT/assert-tests.log" | tail -n 15 || status=1 ;;
        host-probe) PYTHONPATH="$PWD" $PY tools/host_probe.py 2>&1 | tee "$OUT/host-probe.log" | grep -E "host" || status=1 ;;
        model-probe) PYTHONPATH="$PWD" $PY tools/model_host_probe.py 1 64 2>&1 | tee "$OUT/model-probe.log" \
                         | grep -v Warning || status=1 ;;
        gate-routing) $PY -m pytest tests/test_gate_routing.py tests/test_chained_routing.py tests/test_routing.py -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning \
                          2>&1 | tee "$OUT/gate-routing-tests.log" | tail -n 5 || status=1
                      $PY -m moe_kernels.bench.routing --gate-routing --record ${GATE_ROUTING_ARGS:-} 2>&1 | tee "$OUT/gate-routing.log" \
                          | grep -v Warning || status=1 ;;
        prefill) PYTHONPATH="$PWD" $PY tools/prefill_ab.py 2>&1 | tee "$OUT/prefill.log" | grep -v Warning || status=1 ;;
        one-launch) PYTHONPATH="$PWD" $PY tools/one_launch_ab.py 2>&1 | tee "$OUT/one-launch.log" | grep -v Warning \
                        || status=1 ;;
        launch-floor) PYTHONPATH="$PWD" $PY tools/launch_floor.py 2>&1 | tee "$OUT/launch-floor.log" | grep -v Warning \
                          || status=1 ;;
        l2-flush) # session 36: short calls timed with do_bench's zeroing flush, the clean one, and inside a graph
                  PYTHONPATH="$PWD" $PY tools/l2_flush_ab.py l2-flush-ab-stages 2>&1 | tee "$OUT/l2-flush.log" \
                      | grep -v Warning || status=1 ;;
        fp8-flushes) # session 36: bench fp8 at decode under each flush (MOE_KERNELS_L2_FLUSH), records named by it
                     for flush in zero clean; do
                         MOE_KERNELS_L2_FLUSH=$flush $PY -m moe_kernels.bench fp8 --batches 1,8,64,512 --record \
                             --name "fp8-sweep-$flush" 2>&1 | tee "$OUT/fp8-$flush.log" | grep -E "GEMMs|TB/s" || status=1
                     done ;;
        tile-read) PYTHONPATH="$PWD" $PY tools/tile_read_ab.py ${TILE_READ_ARGS:-} 2>&1 | tee "$OUT/tile-read.log" \
                       | grep -v Warning || status=1 ;;
        id-check-gemm1) PYTHONPATH="$PWD" $PY tools/id_check_gemm1_ab.py ${ID_CHECK_GEMM1_ARGS:-} 2>&1 | tee "$OUT/id-check-gemm1.log" \
                            | grep -v Warning || status=1 ;;
        layer) # the layer as a caller sees it (host, GPU, the layer against its GEMMs) at LAYER_BATCHES, recorded as
               # LAYER_NAME or layer-cost-new (layer-cost.json is the record the book compares with); first the GPU tests of the layer's paths, the routers and the graphs
               $PY -m pytest tests/test_layer_path.py tests/test_chained_routing.py tests/test_cuda_graphs.py \
                   tests/test_replay.py -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning 2>&1 \
                   | tee "$OUT/layer-tests.log" | tail -n 5 || status=1
               $PY -m moe_kernels.bench layer --batches "${LAYER_BATCHES:-1,8,64,256}" --record \
                   --name "${LAYER_NAME:-layer-cost-new}" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/layer.log" | grep -v Warning | tail -n 40 || status=1 ;;
        id-check) $PY -m moe_kernels.bench layer --id-check-only --id-check-pairs "${ID_CHECK_PAIRS:-101}" \
                      --batches "${ID_CHECK_BATCHES:-1,8,64,512,4096}" --record ${ID_CHECK_NAME:+--name "$ID_CHECK_NAME"} 2>&1 | tee "$OUT/${ID_CHECK_NAME:-id-check}.log" \
                      | tail -n 25 || status=1 ;;
        model) $PY -m moe_kernels.bench model --batches "${MODEL_BATCHES:-1,8,64}" --rounds "${MODEL_ROUNDS:-5}" --steps "${MODEL_STEPS:-10}" \
                   ${MODEL_ARGS:-} --record ${MODEL_NAME:+--name "$MODEL_NAME"} 2>&1 \
                   | tee "$OUT/model.log" | grep -v Warning | tail -n 40 || status=1 ;;
        unmarked) # the tests that are not marked gpu but run compiled on a GPU machine (the CPU runs them under the
                  # interpreter, which accepts code a GPU build refuses: session 26 found a top-1 router that did not
                  # compile): one file at a time, UNMARKED_TIMEOUT_S each (default 200), short tracebacks
                  for file in ${UNMARKED_FILES:-tests/test_chained_routing.py tests/test_gate_routing.py tests/test_routing.py \
                              tests/test_align.py tests/test_permute.py tests/test_index_gather.py tests/test_gemm_variants.py \
                              tests/test_gluon_block_fp8.py}; do
                      timeout "${UNMARKED_TIMEOUT_S:-200}" $PY -m pytest "$file" -m "not gpu" -q -p no:cacheprovider --tb=short \
                          -W ignore::DeprecationWarning >> "$OUT/unmarked-tests.log" 2>&1
                      echo "$file: exit $?" | tee -a "$OUT/unmarked-tests.log"
                  done
                  grep -E "^FAILED|passed|failed" "$OUT/unmarked-tests.log" | tail -n 40 || status=1 ;;
        fp8-permute-tests) # sessions 27-28: candidates for the fp8 permute layer, first GPU run (one call): the new
                     # GPU tests first (persistent and quantising Gluon kernels, the one-pass input, the quantiser's
                     # tiles), then the unmarked tests of test_quant_scatter.py and test_fp8.py, compiled
                     timeout 280 $PY -m pytest tests/test_gluon_block_fp8.py tests/test_quant_scatter.py tests/test_fp8.py \
                         -q -p no:cacheprovider --tb=short -W ignore::DeprecationWarning $PARALLEL \
                         -k "(persistent or quantising or rows_used or permute_layout or quant or scatter or tile or slot) and not transposed" \
                         > "$OUT/fp8-permute-tests.log" 2>&1
                     grep -E "^FAILED|passed|failed" "$OUT/fp8-permute-tests.log" | tail -n 20 || status=1 ;;
        fp8-permute-ab) # then the A/Bs that decide permute.ONE_PASS_FP8_INPUT, GLUON_PERSISTENT,
                     # GLUON_QUANTIZE_IN_GEMM1, FP8_GEMM and quant.QUANT_TILE (one call; records gluon-block-fp8-ab,
                     # permute-gluon-stages, quant-ab, layer-layout-ab: the first two feed Tables 12.5 and 12.6,
                     # so commit them under other names unless whole)
                     for tool in "gluon_block_fp8_ab.py qwen3-30b-a3b,deepseek-v3 16384" \
                                 "permute_gluon_stages.py qwen3-30b-a3b,deepseek-v3 4096,16384" "quant_ab.py" \
                                 "layer_layout_ab.py qwen3-30b-a3b,deepseek-v3 4096,16384"; do
                         PYTHONPATH="$PWD" timeout 140 $PY tools/$tool 2>&1 | grep -v Warning | tee -a "$OUT/fp8-permute.log" \
                             | tail -n 30 || status=1
                     done ;;
        decode-transposed-tests) # session 28: the transposed Gluon kernel (decode: weights on wgmma's M, tokens on N;
                     # fp8 and bf16): its GPU tests (one call; then decode-transposed-ab in another)
                     timeout 500 $PY -m pytest tests/test_gluon_transposed.py tests/test_gluon_block_fp8.py -q \
                         -p no:cacheprovider --tb=short -W ignore::DeprecationWarning -k "transposed" $PARALLEL \
                         > "$OUT/decode-transposed-tests.log" 2>&1
                     grep -E "^FAILED|passed|failed" "$OUT/decode-transposed-tests.log" | tail -n 20 || status=1 ;;
        first-run) # sessions 27-29's kernels in one call of about 560 s, if one call is all a session gets: their GPU
                   # tests (transposed, persistent, quantising, half tiles, the Gluon replay) on 8 processes, then
                   # the decode A/B on Qwen3 and the prefill GEMMs' A/B on DeepSeek-V3 at 16,384 tokens
                   timeout 200 $PY -m pytest tests/test_gluon_transposed.py tests/test_gluon_block_fp8.py \
                       tests/test_quant_scatter.py tests/test_fp8.py tests/test_replay.py -q -p no:cacheprovider \
                       --tb=short -W ignore::DeprecationWarning $PARALLEL -rf -k "transposed or persistent or \
                       quantising or rows_used or permute_layout or quant or scatter or tile or slot or gluon" \
                       > "$OUT/first-run-tests.log" 2>&1
                   grep -E "^FAILED|passed|failed" "$OUT/first-run-tests.log" | tail -n 14 || status=1
                   PYTHONPATH="$PWD" timeout 220 $PY tools/transposed_decode_ab.py qwen3-30b-a3b 1,8,64,256 2>&1 \
                       | grep -v Warning | tee "$OUT/first-run-decode.log" | tail -n 10 || status=1
                   tar czf "$OUT/results.tgz" results
                   PYTHONPATH="$PWD" timeout 120 $PY tools/gluon_block_fp8_ab.py deepseek-v3 16384 2>&1 | grep -v Warning \
                       | tee "$OUT/first-run-prefill.log" | tail -n 12 || status=1 ;;
        half-tiles) # session 30: half tiles on the per-tile Gluon kernel, first GPU run (one call of about 520 s): its
                    # tests and the fp8 permute layer's, the prefill GEMMs' A/B at 16,384 tokens, the routed layer
                    timeout 150 $PY -m pytest tests/test_gluon_block_fp8.py -q -p no:cacheprovider --tb=short \
                        -W ignore::DeprecationWarning $PARALLEL -rf -k "half or permute_layout" \
                        > "$OUT/half-tiles-tests.log" 2>&1
                    grep -E "^FAILED|passed|failed" "$OUT/half-tiles-tests.log" | tail -n 14 || status=1
                    PYTHONPATH="$PWD" timeout 150 $PY tools/gluon_block_fp8_ab.py deepseek-v3,qwen3-30b-a3b 16384 2>&1 \
                        | grep -v Warning | tee "$OUT/half-tiles-gemms.log" | tail -n 24 || status=1
                    tar czf "$OUT/results.tgz" results
                    LAYER_AB_FORMATS=block PYTHONPATH="$PWD" timeout 200 $PY tools/layer_layout_ab.py \
                        deepseek-v3,qwen3-30b-a3b 16384,4096 2>&1 \
                        | grep -v Warning | tee "$OUT/half-tiles-layer.log" | tail -n 30 || status=1 ;;
        s30) # session 30 in one call (about 560 s): the tests of the half tiles and of the grids' new loads, the prefill GEMMs' A/B and the routed layer on
             # DeepSeek-V3 at 16,384 tokens, then decode's stages on Qwen3-30B-A3B
             timeout 200 $PY -m pytest tests/test_gluon_block_fp8.py tests/test_gluon_transposed.py -q -p no:cacheprovider \
                 --tb=short -W ignore::DeprecationWarning $PARALLEL -rf \
                 -k "half or permute_layout or persistent or transposed" > "$OUT/s30-tests.log" 2>&1
             grep -E "^FAILED|passed|failed" "$OUT/s30-tests.log" | tail -n 14 || status=1
             PYTHONPATH="$PWD" timeout 100 $PY tools/gluon_block_fp8_ab.py deepseek-v3 16384 2>&1 | grep -v Warning \
                 | tee "$OUT/s30-gemms.log" | tail -n 12 || status=1
             tar czf "$OUT/results.tgz" results
             LAYER_AB_FORMATS=block PYTHONPATH="$PWD" timeout 120 $PY tools/layer_layout_ab.py deepseek-v3 16384 2>&1 \
                 | grep -v Warning | tee "$OUT/s30-layer.log" | tail -n 6 || status=1
             tar czf "$OUT/results.tgz" results
             DECODE_STAGES_FORMATS=block PYTHONPATH="$PWD" timeout 130 $PY tools/decode_stages.py qwen3-30b-a3b 1,8,64,256 \
                 2>&1 | grep -v Warning \
                 | tee "$OUT/s30-decode.log" | tail -n 10 || status=1 ;;
        s30-layer) # session 30's second call: the routed fp8 layer on each Gluon variant, both models, 4,096 and 16,384
                   # tokens (records layer-layout-ab), then Qwen3-30B-A3B's prefill GEMMs (gluon-block-fp8-ab)
                   LAYER_AB_FORMATS=block PYTHONPATH="$PWD" timeout 300 $PY tools/layer_layout_ab.py \
                       deepseek-v3,qwen3-30b-a3b 16384,4096 2>&1 | grep -v Warning | tee "$OUT/s30-layer.log" | tail -n 6 \
                       || status=1
                   tar czf "$OUT/results.tgz" results
                   PYTHONPATH="$PWD" timeout 100 $PY tools/gluon_block_fp8_ab.py qwen3-30b-a3b 16384 2>&1 | grep -v Warning \
                       | tee "$OUT/s30-gemms.log" | tail -n 20 || status=1 ;;
        s30-defaults) # session 30's defaults (the one-pass fp8 input, the persistent Gluon grid with GEMM 1 quantising,
                      # fp8 layout choices naming the Gluon GEMMs): the GPU tests of the layer, the permute layout and
                      # the replay, then the routed layer with "auto" on the new choices (records layer-layout-ab)
                      timeout 260 $PY -m pytest tests/test_layer_path.py tests/test_replay.py tests/test_quant_scatter.py \
                          tests/test_fp8.py tests/test_gluon_block_fp8.py tests/test_permute.py -m gpu -q -p no:cacheprovider \
                          --tb=short -W ignore::DeprecationWarning $PARALLEL -rf > "$OUT/s30-defaults-tests.log" 2>&1
                      grep -E "^FAILED|passed|failed" "$OUT/s30-defaults-tests.log" | tail -n 14 || status=1
                      LAYER_AB_FORMATS=block PYTHONPATH="$PWD" timeout 200 $PY tools/layer_layout_ab.py \
                          deepseek-v3,qwen3-30b-a3b 16384,4096 2>&1 | grep -v Warning | tee "$OUT/s30-layer.log" | tail -n 6 \
                          || status=1 ;;
        tma-store) # session 30's TMA-store epilogue for GEMM 2 on the persistent grid, first GPU run (one call, about
                   # 300 s): its tests, then the prefill GEMMs' A/B on both models at 16,384 tokens
                   timeout 150 $PY -m pytest tests/test_gluon_block_fp8.py -q -p no:cacheprovider --tb=short \
                       -W ignore::DeprecationWarning $PARALLEL -rf -k "tma_store" > "$OUT/tma-store-tests.log" 2>&1
                   grep -E "^FAILED|passed|failed" "$OUT/tma-store-tests.log" | tail -n 14 || status=1
                   PYTHONPATH="$PWD" timeout 150 $PY tools/gluon_block_fp8_ab.py qwen3-30b-a3b,deepseek-v3 16384 2>&1 \
                       | grep -v Warning | tee "$OUT/tma-store-gemms.log" | tail -n 24 || status=1 ;;
        s31) # session 31's follow-up in one call (about 450 s): the routed fp8 layer with "auto" at 4,096 and 16,384
             # tokens (the spill-free alignment) beside GEMM 2 on half tiles (records layer-layout-ab), the unmarked
             # tests fixed after their first compiled run, bench fp8 (records fp8-sweep: the prefill Gluon row
             # from 1,024 tokens, for the H200's crossovers), then Qwen3's layer stage by stage
             LAYER_AB_LAYOUTS=index_gather,auto LAYER_AB_FORMATS=block \
                 LAYER_AB_GLUON_ROWS="permute gluon persistent quantising,permute gluon persistent quantising gemm2-half" \
                 PYTHONPATH="$PWD" timeout 150 $PY tools/layer_layout_ab.py deepseek-v3,qwen3-30b-a3b 16384,4096 2>&1 \
                 | grep -v Warning | tee "$OUT/s31-layer.log" | tail -n 4 || status=1
             tar czf "$OUT/results.tgz" results
             timeout 120 $PY -m pytest tests/test_permute.py tests/test_align.py tests/test_quant_scatter.py -q \
                 -p no:cacheprovider --tb=short -W ignore::DeprecationWarning $PARALLEL -rf \
                 -k "bad_inputs or tma_fp8 or block_scales_one or without_copy or quant" > "$OUT/s31-tests.log" 2>&1
             grep -E "^FAILED|passed|failed" "$OUT/s31-tests.log" | tail -n 14 || status=1
             timeout 160 $PY -m moe_kernels.bench fp8 --record 2>&1 | grep -v Warning > "$OUT/fp8.log"
             grep -E " (1024|2048|4096|16384) .*(block GEMMs|permute gluon|scaled)" "$OUT/fp8.log" || status=1
             tar czf "$OUT/results.tgz" results
             # where Qwen3's layer spends what is not GEMM (records permute-gluon-stages: Table 12.6's name, so
             # commit it under another)
             PYTHONPATH="$PWD" timeout 100 $PY tools/permute_gluon_stages.py qwen3-30b-a3b 16384 2>&1 | grep -v Warning \
                 | tee "$OUT/s31-stages.log" | tail -n 34 || status=1 ;;
        shared-fused) # session 32 (issue 19): DeepSeek-V3's routed experts with the shared expert fused as slot E tuned
                      # in fp8 at decode (SHARED_FUSED_BATCHES, the E+1 tables written, budget SHARED_FUSED_TUNE_S), then
                      # the layer with the shared expert left out, separate and fused (records shared-expert-ab)
            timeout $(( ${SHARED_FUSED_TUNE_S:-240} + 120 )) $PY -m moe_kernels.bench tune --fused-shared --format block \
                --models deepseek-v3 --batches "${SHARED_FUSED_BATCHES:-1,8,64}" --budget-s "${SHARED_FUSED_TUNE_S:-240}" \
                --record --write-tables 2>&1 | grep -v Warning | tee "$OUT/shared-fused-tune.log" | tail -n 6 || status=1
            tar czf "$OUT/results.tgz" results moe_kernels/kernels/configs
            PYTHONPATH="$PWD" timeout 200 $PY tools/shared_expert_ab.py "${SHARED_AB_BATCHES:-1,8,64,512}" block 2>&1 \
                | grep -v Warning | tee "$OUT/shared-expert-ab.log" | tail -n 8 || status=1 ;;
        bf16-prefill) # session 33 (issue 18): the routed bf16 layer on index-gather, the permute layout's Triton GEMMs, "auto"
                      # and the bf16 Gluon GEMMs (with half tiles, with GEMM 1's TMA store) at 1,024-16,384 tokens
                      # (records layer-layout-ab: commit under another name), then the GEMMs alone (prefill-gemm-ab-gluon-bf16)
            LAYER_AB_LAYOUTS=index_gather,permute,auto LAYER_AB_FORMATS=none LAYER_AB_GLUON_ROWS=0 PYTHONPATH="$PWD" \
                timeout 150 $PY tools/layer_layout_ab.py qwen3-30b-a3b,deepseek-v3 16384,4096,2048,1024 2>&1 \
                | grep -v Warning | tee "$OUT/bf16-layer.log" | tail -n 8 || status=1
            tar czf "$OUT/results.tgz" results
            PREFILL_AB_TILES=1 PREFILL_AB_ALIGNS=128 PYTHONPATH="$PWD" timeout 300 $PY tools/prefill_gemm_ab.py \
                qwen3-30b-a3b,deepseek-v3 16384,4096 none prefill-gemm-ab-gluon-bf16 2>&1 | grep -v Warning \
                | tee "$OUT/bf16-gemms.log" | grep -E "^[a-z]|gluon|bmm|n128 k64 w8 s3 |n256 k64 w8 s3 " || status=1 ;;
        bf16-balanced) # session 34 (issue 18): the bf16 GEMMs alone on real and on balanced routing (no padding: the
                       # kernel's own gap to bmm), the walk's group and two programs an SM, after the walk-order GPU
                       # tests and the L2's read rate; then issue 19's router steps at DeepSeek-V3's 512 tokens
            $PY -m pytest tests/test_gluon_bf16.py -m gpu -q -p no:cacheprovider -k "walk_order" 2>&1 | tail -n 3 \
                | tee "$OUT/bf16-balanced-tests.log" || status=1
            PYTHONPATH="$PWD" timeout 60 $PY tools/l2_read.py 2>&1 | grep -v Warning | tee "$OUT/l2-read.log" || status=1
            PREFILL_AB_TILES=1 PREFILL_AB_ALIGNS=128 PREFILL_AB_GEMMS_ONLY=1 PYTHONPATH="$PWD" timeout 240 $PY \
                tools/prefill_gemm_ab.py qwen3-30b-a3b,deepseek-v3 16384,4096 none prefill-gemm-ab-bf16-balanced 2>&1 \
                | grep -v Warning | tee "$OUT/bf16-balanced.log" | grep -E "^[a-z]|gluon|bmm|balanced" || status=1
            tar czf "$OUT/results.tgz" results
            PYTHONPATH="$PWD" timeout 90 $PY tools/route_steps_ab.py 512 route-steps-ab-512 2>&1 | grep -v Warning \
                | tee "$OUT/route-steps-512.log" | tail -n 30 || status=1 ;;
        bf16-one-pass) # session 34 (issue 18): the bf16 input in one pass (quant_scatter.scatter_rows: each token read
                       # once, written to its k rows) in the routed bf16 layer on the Gluon GEMMs: its GPU tests, then
                       # the layer A/B at 4,096 and 16,384 tokens (records layer-layout-ab: commit under another name)
            $PY -m pytest tests/test_gluon_bf16.py tests/test_quant_scatter.py -q -p no:cacheprovider \
                -k "permute_layout_on_the_bf16 or scatter_rows or three_step" 2>&1 | tail -n 3 \
                | tee "$OUT/bf16-one-pass-tests.log" || status=1
            LAYER_AB_LAYOUTS=index_gather LAYER_AB_FORMATS=none LAYER_AB_GLUON_ROWS=0 PYTHONPATH="$PWD" timeout 200 \
                $PY tools/layer_layout_ab.py qwen3-30b-a3b,deepseek-v3 16384,4096 2>&1 | grep -v Warning \
                | tee "$OUT/bf16-one-pass-layer.log" | tail -n 4 || status=1 ;;
        bf16-defaults) # session 34: the routed bf16 layer on the Gluon GEMMs with the new defaults (the input in one pass,
                       # GEMM 1 on 4 stages from 256 rows an expert) against session 33's and each change alone, at
                       # 4,096-16,384 tokens (records layer-layout-ab: commit under another name)
            $PY -m pytest tests/test_gluon_bf16.py -q -p no:cacheprovider -k "permute_layout_on_the_bf16" 2>&1 \
                | tail -n 2 | tee "$OUT/bf16-defaults-tests.log" || status=1
            LAYER_AB_LAYOUTS=index_gather LAYER_AB_FORMATS=none LAYER_AB_GLUON_ROWS=0 PYTHONPATH="$PWD" \
                timeout 300 $PY tools/layer_layout_ab.py deepseek-v3,qwen3-30b-a3b 16384,8192,4096 2>&1 | grep -v Warning \
                | tee "$OUT/bf16-defaults-layer.log" | tail -n 6 || status=1 ;;
        router-floor) # session 32 (issue 19): bench routing --gate-routing at 1, 64, 512 tokens with the new row, a launch
                      # that only reads as many bytes as the gate's operands (records gate-routing: commit under another name)
            timeout 240 $PY -m moe_kernels.bench routing --gate-routing --batches 1,64,512 --record 2>&1 | grep -v Warning \
                | tee "$OUT/router-floor.log" | tail -n 6 || status=1 ;;
        decode-stages) # session 30: decode's stages alone on index-gather and on the transposed Gluon path, fp8 then
                       # bf16, with the floor and two plain reads (records decode-stages)
                       PYTHONPATH="$PWD" timeout 400 $PY tools/decode_stages.py qwen3-30b-a3b,deepseek-v3 1,8,64,256 2>&1 \
                           | grep -v Warning | tee "$OUT/decode-stages.log" | tail -n 20 || status=1 ;;
        transposed-prefill) # the transposed Gluon kernel's 64-row tiles at prefill, fp8 and bf16 (bf16 has no other Gluon
                            # prefill kernel), against the Triton permute GEMMs and, in fp8, the 128-row Gluon kernel
                            # (records transposed-decode-ab: commit it under another name)
                     TRANSPOSED_AB_ROWS="permute triton a128,gluon a128,gluon a64,gluon a64 one-pass" PYTHONPATH="$PWD" \
                         timeout 300 $PY tools/transposed_decode_ab.py qwen3-30b-a3b,deepseek-v3 4096,16384 2>&1 \
                         | grep -v Warning | tee "$OUT/transposed-prefill.log" | tail -n 8 || status=1 ;;
        decode-transposed-ab) # its A/B against index-gather, fp8 then bf16 (records transposed-decode-ab)
                     PYTHONPATH="$PWD" timeout 540 $PY tools/transposed_decode_ab.py qwen3-30b-a3b,deepseek-v3 1,8,64,256,1024 \
                         2>&1 | grep -v Warning | tee "$OUT/decode-transposed-ab.log" | tail -n 20 || status=1 ;;
        *) $PY -m moe_kernels.bench "$step" --record 2>&1 | tee "$OUT/$step.log" | tail -n 20 || status=1 ;;
    esac
    tar czf "$OUT/results.tgz" results moe_kernels/kernels/configs   # after every step: a run cut short keeps what it measured
done
exit $status
