"""`python -m trainer.grpo`: GRPO, online reinforcement learning with verifiable rewards, from the command line.

    python -m trainer.grpo                                    # the GRPO demo (trainer/configs/grpo_demo.yaml)
    python -m trainer.grpo --model SFT_MODEL --data prompts.jsonl --reward_funcs mymodule:my_reward [any sft flag]
    python -m trainer.grpo config.yaml                        # flags win over the file

It is `python -m trainer.sft --stage grpo`: the same arguments, checks, build, loop, checkpoints, resume, engines
(one process, DDP, FSDP2 or DeepSpeed ZeRO) and exit codes (trainer/cli.py), with prompt records (a "prompt"
holding text or messages, other columns passed to the reward functions) and GRPO's generation, rewards and loss
(trainer/methods/grpo_method.py, grpo.py; TRL's GRPOConfig names). The demo starts from the SFT demo's model,
outputs/demo, and trains that first when it is not there (python -m trainer.sft, about 5 minutes on an idle 2-core
CPU); docs/grpo.md says more.
"""

from trainer.cli import run_command


def main(argv: list[str] | None = None) -> int:
    return run_command("grpo", argv)


if __name__ == "__main__":
    raise SystemExit(main())
