"""Every causal-LM model type transformers knows (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: 196 in transformers 5.24) either
trains through `python -m trainer.sft` (two steps, exit 0, the "transformers path: ..." line printed, or our own model
for the types it covers) or stops with exit 2 and one "error: ..." line naming what is missing, never a
traceback (issue 44's sweep). Each type runs in its own process (tests/trainer/model/type_sweep_worker.py), under a
memory cap, on a tiny random checkpoint that transformers writes from its config class's defaults, shrunk
(tiny_hf.tiny_config). A type whose tiny checkpoint transformers itself cannot write here (a config whose defaults the
shrinking breaks, a vision tower too large for the cap, a missing optional package) is skipped with transformers'
reason: it says nothing about our code; so is one whose run needs more time or memory than the test's caps.

Slow: about 20 s per type on a 2-core machine (an hour in all); run it with -m slow -n 2.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.model.causal_lm import SUPPORTED_MODEL_TYPES, TEXT_MODELS

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

WORKER = Path(__file__).with_name("type_sweep_worker.py")
MEMORY_CAP = 8 << 30  # bytes of address space per type's process
TIMEOUT_S = 300


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_the_type_trains_or_stops_in_one_line(model_type, tmp_path):
    try:
        done = subprocess.run(
            [sys.executable, str(WORKER), model_type, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            preexec_fn=_cap_memory,
            # as a user runs it: tests/conftest.py's TRITON_INTERPRET=1 would run our kernels in Triton's interpreter
            # (our MoE types' grouped GEMMs took over 300 s there, 16 s without)
            env={**os.environ, "TRITON_INTERPRET": "0"},
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"{model_type}: its tiny checkpoint does not train within {TIMEOUT_S} s here (not shrunk enough)")
    if done.returncode != 0 and "Cannot allocate memory" in done.stderr:  # over MEMORY_CAP: got_ocr2's vision tower
        pytest.skip(f"{model_type}: its tiny checkpoint needs over {MEMORY_CAP >> 30} GiB here (not shrunk enough)")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1])
    if not result["written"]:
        pytest.skip(f"{model_type}: transformers cannot write a tiny checkpoint here ({result['why']})")
    assert not result["traceback"], result
    if result["code"] == 0:
        assert result["report"] is not None or model_type in (*SUPPORTED_MODEL_TYPES, *TEXT_MODELS), result
    else:
        assert result["code"] == 2 and len(result["stderr_errors"]) == 1, result
