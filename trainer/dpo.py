"""`python -m trainer.dpo`: preference training (DPO, IPO, hinge, robust, APO-zero, ORPO, SimPO) from the command line.

    python -m trainer.dpo                                   # the DPO demo (trainer/configs/dpo_demo.yaml)
    python -m trainer.dpo --model SFT_MODEL --data pairs.jsonl [--loss_type sigmoid --beta 0.1] [any sft flag]
    python -m trainer.dpo config.yaml                       # LlamaFactory's `stage: dpo` YAML runs as it is

It is `python -m trainer.sft --stage dpo`: the same arguments, checks, build, loop, checkpoints, resume, engines
and exit codes (trainer/cli.py), with preference pairs and the preference loss (trainer/methods/dpo_method.py). The
demo starts from the SFT demo's model, outputs/demo, and trains that first when it is not there (python -m
trainer.sft, about 5 minutes on an idle 2-core CPU).
"""

from trainer.cli import run_command


def run(argv: list[str] | None = None) -> int:
    return run_command("dpo", argv)


if __name__ == "__main__":
    raise SystemExit(run())
