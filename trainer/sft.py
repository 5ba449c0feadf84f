"""`python -m trainer.sft`: supervised fine-tuning from the command line, and LlamaFactory's one command (a config's
`stage:` key, or --stage, picks another method).

    python -m trainer.sft                                   # the embedded demo (trainer/configs/demo.yaml)
    python -m trainer.sft --model PATH_OR_PRESET --data FILE [--eval_data FILE] [--bf16] [any TrainingArguments flag]
    python -m trainer.sft config.yaml [--learning_rate 1e-5]  # flags win over the file

trainer/cli.py conducts the run (its arguments, checks, exit codes); trainer/methods/sft_method.py is the method.
"""

from trainer.cli import run_command


def main(argv: list[str] | None = None) -> int:
    return run_command("sft", argv)


if __name__ == "__main__":
    raise SystemExit(main())
