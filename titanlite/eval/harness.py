"""titanlite's model as an lm-evaluation-harness LM: log-likelihoods and generation.

It asks what lm-eval's own `hf` model asks of a causal model, the same way, so that on the same
weights (the run's HF export) both give the same scores: text is encoded with BOS as the export's
tokenizer does (none when the text starts with it), pairs are split by lm-eval's TemplateLM, an
empty context and rolling windows start with BOS, sequences are cut to the last max_length + 1
tokens, log-probabilities are over the whole (padded) vocabulary as transformers computes them,
and generation stops at `until` or EOS after at most max_gen_toks with the context cut to leave
room for them.

Every process of a job evaluates every request alike (lm-eval is told world size 1): under FSDP,
TP or CP each forward is a collective of all ranks, so all must run the same forwards. Logits a
TP plan leaves sharded over the vocabulary are gathered.
"""

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from titanlite.eval.generate import Sampling, full, generate

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's `hf` default


class TitanliteLM(TemplateLM):
    def __init__(self, model, tokenizer, batch_size: int, model_context=None):
        super().__init__()
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.max_length = model.args.max_seq_len
        self._device = model.rope_cache.device
        self.model_context = model_context or torch.no_grad

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        bos = add_special_tokens
        if bos is None:
            bos = not string.startswith(self.tokenizer.decode([self.tokenizer.bos_id]))
        return self.tokenizer.encode(string, bos=bos, eos=False)

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Log-probabilities [b, s, vocab] of right-padded rows (padding comes after, so it
        changes nothing before it)."""
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long, device=self._device)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        with torch.no_grad(), self.model_context():
            return F.log_softmax(full(self.model(tokens)).float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """[(key, context ids, continuation ids)] -> [(log-likelihood, greedy?)], in order."""
        out = []
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start : start + self.batch_size]
            rows = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in batch]
            logprobs = self._forward(rows)
            for (key, _, cont), row, lp in zip(batch, rows, logprobs, strict=True):
                lp = lp[len(row) - len(cont) : len(row)]  # [cont, vocab]
                want = torch.tensor(cont, device=lp.device)
                greedy = bool((lp.argmax(-1) == want).all())
                out.append((float(lp.gather(-1, want[:, None]).sum()), greedy))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, out[-1])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        scores = []
        for (string,) in (r.args for r in requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )  # fmt: skip
            pairs = [(None, *make_disjoint_window(w)) for w in windows]
            scores.append(sum(ll for ll, _ in self._loglikelihood_tokens(pairs)))
        return scores

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.tokenizer.eos_id])
        out = []
        for context, gen_kwargs in (r.args for r in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new = kwargs["max_gen_toks"]
            prompt = self.tok_encode(context)[-(self.max_length - new) :]
            sampling = Sampling(
                max_new_tokens=new, temperature=kwargs.get("temperature", 0.0) or 0.0,
                stop=tuple(u for u in until if u),
            )  # fmt: skip
            with self.model_context():
                out.append(generate(self.model, self.tokenizer, [prompt], sampling).texts[0])
        return out
