#!/usr/bin/env bash
# ReTrace against its control on SmolLM2-135M (2 CPU cores; hours; results/retrace.md). Every step resumes where it stopped.
#   experiments/smollm2.sh [data|dflash|data_extra|phase2|overwrite|bench|bench_greedy|bench_sampling_and_analyze|ship|fixes]...
# Default (the reported run of 2026-11-30, commit 1a3802b): data_extra phase2 bench ship.
# - Phase 1 (`data dflash`, commit 8f1af98): a DFlash drafter (warm-started from the target's top layers,
#   anchor_broadcast, loss_decay_gamma 2), 450 steps on a 640-response pool; shipped as
#   model_cards/smollm2-135m-dflash, which is where phase 2 starts (PHASE1=...; `PHASE1=$RUNS/dflash` after `dflash`).
# - Phase 2: every arm from that drafter on the same EXTRA pool (640 fresh target responses to prompts disjoint from
#   phase 1's, `data_extra`) for the same steps: ReTrace corrected, the continued-DFlash control, the gated
#   ablation (overwrite: the optional `overwrite` step), and ReTrace with the backbone frozen
#   (`retrace_modules_only`: isolates what the conditioning adds to the very drafter it started from).
# - Bench: every drafter in one interleaved run on held-out prompts, with tau ratios to the control and paired
#   bootstrap intervals over prompts; drafts scored with a bf16 copy of the lm head (verification stays fp32).
# The two earlier runs are kept under results/retrace-150-step-drafter/ and results/retrace-450-step-drafter/.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
PY=.venv/bin/python
PHASE1_STEPS=${PHASE1_STEPS:-450}
PHASE2_STEPS=${PHASE2_STEPS:-80}
RUNS=${RUNS:-runs/v3}
PHASE1=${PHASE1:-model_cards/smollm2-135m-dflash}
PHASE2_DATA=${PHASE2_DATA:-data_cache/phase2-extra}
STEPS=("$@"); [ ${#STEPS[@]} -eq 0 ] && STEPS=(data_extra phase2 bench ship)

data() {  # target-regenerated responses (greedy, fp32), cached and resumable
  $PY training/generate_data.py --target default --mix gsm_symbolic:600,codeio:300,stdlib:300,open_ended:300 \
    --max-new-tokens 256 --batch-size 64 --chunk-size 128 --dtype float32 --num-threads 1 --output data_cache/smollm2
  # The pool grows chunk by chunk (128 prompts, sources in turn: gsm_symbolic, codeio, stdlib, open_ended, ...); the
  # reported run uses the first five chunks (640 rows, ~119K response tokens), what was on disk when training began.
  $PY -c "from datasets import load_from_disk as L; L('data_cache/smollm2/dataset').select(range(640)).save_to_disk('data_cache/phase2')"
}

data_extra() {  # phase 2's extra pool: same mix and recipe, prompt seed 5000 (phase 1: 0; evaluation: >= 10000)
  $PY training/generate_data.py --target default --mix gsm_symbolic:600,codeio:300,stdlib:300,open_ended:300 \
    --seed 5000 --max-new-tokens 256 --batch-size 64 --chunk-size 128 --dtype float32 --num-threads 2 \
    --max-responses 640 --output data_cache/smollm2-extra  # 5 chunks of 128: gsm, codeio, stdlib, open_ended, gsm
  $PY -c "from datasets import load_from_disk as L; L('data_cache/smollm2-extra/dataset').select(range(640)).save_to_disk('$PHASE2_DATA')"
}

dflash() {  # alone on the machine: 2 threads (~4-5 s/step)
  OMP_NUM_THREADS=2 $PY training/train.py --config training/recipes/smollm2-135m-dflash.yaml \
    --dataset_name data_cache/phase2 --max_steps "$PHASE1_STEPS" --save_steps 25 --output_dir "$RUNS/dflash"
}

phase2_arm() {  # name, then extra train.py flags
  local name=$1; shift
  $PY training/train.py --config training/recipes/smollm2-135m-retrace.yaml --dataset_name "$PHASE2_DATA" \
    --drafter_name_or_path "$PHASE1" --max_steps "$PHASE2_STEPS" --save_steps 20 --output_dir "$RUNS/$name" "$@"
}

phase2() {  # two lanes, one thread each; a ReTrace step costs ~1.8x a DFlash one (two rounds + verification tails)
  { phase2_arm control --training_mode dflash --retrace_mode off
    phase2_arm retrace-modules --training_mode retrace_modules_only --retrace_mode corrected; } &
  { phase2_arm retrace --training_mode retrace --retrace_mode corrected
    phase2_arm gated --training_mode retrace --retrace_mode gated; }
  wait
}

overwrite() {  # the third ablation, trained and benched after the others for time (the reported run: 2 threads)
  OMP_NUM_THREADS=2 phase2_arm overwrite --training_mode retrace --retrace_mode overwrite
  # greedy tau is deterministic, so the control's tau here equals the main bench's; tokens/s is a separate run's
  $PY -m hf_retrace.bench.run --target default --dtype fp32 --num-threads 2 --max-new-tokens 64 \
    --draft-logits-dtype bfloat16 --prompt-sets gsm_symbolic:12,humaneval:12 --baseline control \
    --methods ar,control="$RUNS/control":off,overwrite="$RUNS/overwrite" --output-dir results/smollm2-overwrite
}

bench() {  # greedy bench on one thread, sampling bench then rejected-suffix analysis on the other
  bench_greedy &
  bench_sampling_and_analyze
  wait
}

bench_greedy() {  # every method on the same held-out prompts, interleaved, lossless-checked
  local OVERWRITE=""; [ -f "$RUNS/overwrite/config.json" ] && OVERWRITE=",overwrite=$RUNS/overwrite"
  $PY -m hf_retrace.bench.run --target default --dtype fp32 --num-threads 1 --max-new-tokens 64 \
    --draft-logits-dtype bfloat16 --prompt-sets gsm_symbolic:12,humaneval:12 --baseline control \
    --methods ar,prompt_lookup,dflash="$PHASE1",control="$RUNS/control":off,retrace="$RUNS/retrace",gated="$RUNS/gated",retrace_modules="$RUNS/retrace-modules"$OVERWRITE \
    --output-dir results/smollm2
}

bench_sampling_and_analyze() {
  # sampling at temperature 1: DFlash control vs ReTrace (no lossless check; tau and speed)
  $PY -m hf_retrace.bench.run --target default --dtype fp32 --num-threads 1 --max-new-tokens 64 --do-sample \
    --draft-logits-dtype bfloat16 --temperature 1.0 --seed 0 --prompt-sets gsm_symbolic:6,humaneval:6 \
    --baseline control --methods ar,control="$RUNS/control":off,retrace="$RUNS/retrace" \
    --output-dir results/smollm2-sampling
  $PY -m hf_retrace.bench.analyze --drafter "$PHASE1":off --prompt-sets gsm_symbolic:8,humaneval:8 \
    --max-new-tokens 64 --num-threads 1 --output-dir results/smollm2-analyze
}

fixes() {  # optional (not in the default run): the attempted fix of commit db01d2c, ReTrace with teacher-forced
  # verification features (same data/steps), benched vs the arms; its result is in
  # results/retrace-150-step-drafter/smollm2-fixes/
  phase2_arm retrace-tf --training_mode retrace --retrace_mode corrected --verification_features teacher_forced
  $PY -m hf_retrace.bench.run --target default --dtype fp32 --num-threads 2 --max-new-tokens 64 \
    --prompt-sets gsm_symbolic:5,humaneval:5 \
    --methods ar,control="$RUNS/control":off,retrace="$RUNS/retrace",retrace_tf="$RUNS/retrace-tf" \
    --output-dir results/smollm2-fixes
}

ship() {  # publishable folders under model_cards/ (card, config, safetensors committed; code files git-ignored)
  RUNS="$RUNS" PHASE1="$PHASE1" $PY - <<'PY'
import os
import shutil
import tempfile
import torch
from hf_retrace import ReTraceDrafterModel
from hf_retrace.hub.publish import save_for_hub
runs = os.environ["RUNS"]
phase1 = os.environ["PHASE1"]
arms = [(f"{runs}/retrace", "smollm2-135m-retrace", "corrected"), (phase1, "smollm2-135m-dflash", "off")]
for run, name, mode in arms:
    copy = shutil.copytree(run, tempfile.mkdtemp() + "/drafter")  # the folder may be the card being rewritten
    drafter = ReTraceDrafterModel.from_pretrained(copy, dtype=torch.bfloat16)
    drafter.set_retrace_mode(mode)
    drafter.generation_config.draft_logits_dtype = "bfloat16"  # drafts only; 7x cheaper on CPU fp32 targets
    # repo id the folder is meant for (not uploaded from here: no Hub access); `hf-retrace publish` rewrites it
    save_for_hub(drafter, f"model_cards/{name}", repo_id=f"hf-retrace/{name}",
                 base_model="HuggingFaceTB/SmolLM2-135M-Instruct", eval_results_json="results/smollm2/results.json")
PY
}

for step in "${STEPS[@]}"; do "$step"; done
