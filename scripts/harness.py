"""Score a checkpoint with EleutherAI's lm-evaluation-harness: HellaSwag, LAMBADA, ARC, ... natively.

    python -m scripts.harness --ckpt out/small --tasks tinygpt_cloze       # the repo's offline task, harness_tasks/
    python -m scripts.harness --ckpt out/gpt2 --tasks hellaswag,lambada_openai    # the tasks' data: HF hub
    python -m scripts.harness --ckpt out/gpt2-run --tasks arc_easy --limit 200    # a quick look, not a result

``TinyGPTLM`` is lm_eval's model interface on our GPT and tokenizer: no export, char models too (docs/evaluation.md)."""
import sys

if not __package__:  # run as a file, `python scripts/harness.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.harness", file=sys.stderr)
    sys.exit(2)

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from checkpoint import add_weights_flags, flags_checkpoint, from_flags
from cli import CommandLine, ConfigError, DataError, exit_on_errors, fail, install_hint, run_tool
from config import FIELD_HELP, REPO
from model import GPT
from runtime import atomic_write_text, pick_device
from sample import generate
from scripts.bench import check_results_path
from scripts.import_hf import hub_unreachable

try:
    import lm_eval
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.tasks import TaskManager
except ImportError:
    fail(f"lm-evaluation-harness is not installed: {install_hint('lm_eval')}")

LOCAL_TASKS = REPO / "scripts" / "harness_tasks"  # the repo's own tasks, found by name like the harness's
LOCAL_TASK_NAMES = sorted(path.stem for path in LOCAL_TASKS.glob("*.yaml"))


class TinyGPTLM(TemplateLM):
    """lm_eval's model interface over a tinygpt GPT (in eval mode) and its tokenizer."""

    def __init__(self, model: GPT, tokenizer, batch_size: int = 8, max_gen_toks: int = 256):
        super().__init__()
        self.model, self.tok, self._device = model.eval(), tokenizer, next(model.parameters()).device
        self.batch_size, self.max_gen_toks, self.max_length = batch_size, max_gen_toks, model.config.block_size

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_token  # GPT-2's <|endoftext|>; a char model's newline

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        try:
            return self.tok.encode(string)  # GPT-2: <|endoftext|> in the text is text, as in training
        except DataError as err:  # a char model meets a character it never saw
            raise DataError(f"the task's text: {err}; a char model scores only text in its own characters") from None

    def _loglikelihood_tokens(self, requests: list[tuple], disable_tqdm: bool = False, **kwargs) -> list[tuple]:
        """(log p(continuation | context), whether greedy decoding gives it) per (key, context, continuation)."""
        answers: list[tuple[float, bool] | None] = [None] * len(requests)
        longest_first = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        batches = range(0, len(requests), self.batch_size)
        for start in tqdm(batches, disable=disable_tqdm or len(batches) < 2, desc="loglikelihood"):
            batch = longest_first[start: start + self.batch_size]
            for i, answer in zip(batch, self.score_batch([requests[i][1:] for i in batch])):
                answers[i] = answer
                if requests[i][0] is not None:  # None: a rolling window, cached as a whole text instead
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return answers

    @torch.no_grad()
    def score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Per (context ids, continuation ids): the continuation's log-likelihood and whether greedy gives it."""
        if bad := [len(c) for _, c in pairs if not 0 < len(c) <= self.max_length]:
            raise ValueError(f"a continuation of {bad[0]} tokens; the model scores 1 to {self.max_length} (its "
                             "block_size) at once")
        inputs = [(context + continuation)[-(self.max_length + 1):-1] for context, continuation in pairs]
        idx = pad_sequence([torch.tensor(ids) for ids in inputs], batch_first=True)  # (B, T), right-padded with 0
        logits = self.model(idx.to(self.device)).logits  # (B, T, vocab)
        answers = []
        for row, (ids, (_, continuation)) in enumerate(zip(inputs, pairs)):
            n = len(continuation)
            # Position t predicts token t + 1: the last n positions of the row predict the continuation.
            logprobs = F.log_softmax(logits[row, len(ids) - n: len(ids)].float(), dim=-1)  # (n, vocab)
            target = torch.tensor(continuation, device=logprobs.device)  # (n,)
            total = logprobs.gather(-1, target[:, None]).sum()
            answers.append((total.item(), bool((logprobs.argmax(-1) == target).all())))
        return answers

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="loglikelihood_rolling"):
            windows = lm_utils.get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length,
                                                         context_len=1)
            pairs = [(None, *lm_utils.make_disjoint_window(w)) for w in windows]
            total = sum(logprob for logprob, _ in self._loglikelihood_tokens(pairs, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to its first stop sequence: greedy unless sampled."""
        outputs = []
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm, desc="generate_until"):
            until = gen_kwargs.get("until") or [self.tok.decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            sampled = gen_kwargs.get("do_sample", False) and gen_kwargs.get("temperature", 0.0) > 0
            prompt = self.tok_encode(context) or [self.eot_token_id]
            n = len(prompt)
            out = generate(self.model, torch.tensor([prompt], device=self.device),
                           gen_kwargs.get("max_gen_toks", self.max_gen_toks),
                           temperature=gen_kwargs["temperature"] if sampled else 0.0,
                           stop=lambda idx: any(s in self.tok.decode(idx[0, n:].tolist()) for s in until))  # idx (1, T)
            text = self.tok.decode(out[0, n:].tolist())
            for stop in until:
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            outputs.append(text)
        return outputs


def task_manager(names: list[str]) -> TaskManager:
    """The harness's task index: ours alone when they hold every name (indexing all the harness's takes seconds)."""
    return TaskManager(include_path=str(LOCAL_TASKS), include_defaults=not set(names) <= set(LOCAL_TASK_NAMES))


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    add_weights_flags(parser)
    parser.add_argument("--tasks", required=True, help="comma-separated lm_eval task or group names; offline, the "
                        "repo's own: " + ", ".join(LOCAL_TASK_NAMES))
    parser.add_argument("--num_fewshot", "--num-fewshot", type=int, default=None,
                        help="examples in each prompt (default: each task's own, usually 0)")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (a fraction if < 1): for a quick look, never a number to quote")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=8, help="requests per forward pass")
    parser.add_argument("--device", default="auto", help=FIELD_HELP["device"])
    parser.add_argument("--output", default="", help="results JSON (default: harness-TASKS.json in the run folder)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.num_fewshot or 0) < 0:
        parser.error("need --batch_size >= 1 and --num_fewshot >= 0")
    if args.limit is not None and not (0 < args.limit < 1 or args.limit >= 1 and args.limit.is_integer()):
        parser.error(f"--limit must be a fraction in (0, 1) or a whole number of documents, got {args.limit:g}")
    with exit_on_errors():  # one line and its exit code
        names = [name.strip() for name in args.tasks.split(",") if name.strip()]
        output = Path(args.output or flags_checkpoint(args).parent / f"harness-{'+'.join(names)}.json")  # in the run
        check_results_path(output, "--output")  # before minutes of evaluation, not after
        manager = task_manager(names)  # once: the check and the evaluation share it
        if (unknown := [name for name in names if name not in manager.all_tasks]) or not names:
            raise ConfigError(f"unknown task(s) {', '.join(unknown) or '(none given)'}; list them with "
                              f"`lm_eval ls tasks`, or see {LOCAL_TASKS.relative_to(REPO)}/ for the offline ones")
        remote = [name for name in names if name not in LOCAL_TASK_NAMES]  # refused now, not after minutes of retries
        if remote and os.environ.get("HF_DATASETS_OFFLINE") != "1" and (reason := hub_unreachable("gpt2")):
            raise ConfigError(f"the Hugging Face hub is unreachable ({reason}) and task(s) {', '.join(remote)} need "
                              "their data from it; if it is in your datasets cache, rerun with HF_DATASETS_OFFLINE=1")
        loaded = from_flags(args, pick_device(args.device))
        lm = TinyGPTLM(loaded.model, loaded.tokenizer, batch_size=args.batch_size)
        try:
            results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager,
                                              num_fewshot=args.num_fewshot, limit=args.limit, log_samples=False)
        except OSError as err:  # data that cannot be fetched (ConnectionError too): one line, not a traceback
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"could not load the data of {', '.join(names)} ({first_line}); the harness's tasks "
                              "download it from the Hugging Face hub; this repo's tasks run offline") from None
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, json.dumps(results, indent=2, default=lm_utils.handle_non_serializable) + "\n")
    print(f"# {loaded.source} on {', '.join(names)} (lm_eval {lm_eval.__version__})")
    print(lm_utils.make_table(results))
    print(f"results: {output}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_tool(main)
