"""The generation engine every rank runs: one chat request in, one reply out, with every rank stepping together.

Rank 0 owns the conversation and sends each rank the whole :class:`GenerationRequest`; every
rank then calls :func:`generate` with it. `model.generate` runs with `synced_gpus=True` in a
thread of its own, so a rank that is done (end of text, interrupt) keeps running dummy
forwards until every rank is done and no rank is left alone in a collective. The calling
thread hands the text to `on_text` (rank 0) and waits with a deadline, so an exception or a
dead peer surfaces as an error naming the rank instead of a hang.

Stopping is decided by every rank together (:class:`SyncedStop`): each step, each rank's
reasons to stop (its `stop_event`, an end-of-text token, a stop string, its own token limit) go
through one all-reduce (MAX), so every rank ends at the same step and feeds the same tokens until
then. A rank that stopped alone would go on with dummy forwards of a padding token while the
others decode: under `tp` and expert parallelism their forwards add partial sums of different
tokens. All of transformers' own stop reasons are taken over by `SyncedStop` (it is given no
end-of-text ids or stop strings, and the largest token limit of any rank), so no rank ever
finishes on its own, and every rank runs the criterion, with its collective, at every step.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from shardbook.rankd.config.schema import InferenceConfig
from shardbook.rankd.control import user_calls
from shardbook.rankd.control.agreement import agree
from shardbook.rankd.control.text import check_valid
from shardbook.rankd.control.world import set_current_device
from shardbook.rankd.generation.cache_keyword import cache_keyword
from shardbook.rankd.generation.chat_template import apply_chat_template
from shardbook.rankd.generation.intervention_state import Rows, applied_to
from shardbook.rankd.generation.reply_text import DECODE_KWARGS, reply_decoder
from shardbook.rankd.generation.row_attention import over_latents
from shardbook.rankd.generation.sampling import check_sampling
from shardbook.rankd.generation.streaming import StopTextFilter, TextDeltaStreamer, find_stop

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
"""Longest wait for the next step or token before a rank gives up (a prefill of a long prompt counts as one step)."""
PREFILL_CHUNK = 512
"""Prompt tokens per forward of the prefill: every rank checks for an interrupt between chunks, alike."""
NUM_ALTERNATIVES = 5
"""Alternatives recorded per generated token when a request wants scores."""
MAX_STOP_CHARS = 256
"""Longest stop string a request may give (longer ones are refused: checking them each step costs every rank)."""
PLAN_WORDS = "build the prompt for this chat request"
"""What a rank that fails in :func:`plan_generation` could not do, for the other ranks' errors."""


@dataclass(frozen=True)
class GenerationRequest:
    """One chat turn as rank 0 sends it to every rank: the whole conversation and the sampling settings.

    Unset settings take the defaults of the config's `inference` section (`InferenceConfig`).
    """

    messages: list[dict[str, str]]
    """The conversation so far, as `{"role": ..., "content": ...}` dicts; the reply continues it."""
    max_new_tokens: int = InferenceConfig.max_new_tokens
    """Most tokens to generate (fewer when the model's context is shorter)."""
    do_sample: bool = InferenceConfig.do_sample
    """Sample the next token (True) or take the most likely one (False, greedy)."""
    temperature: float = InferenceConfig.temperature
    """Sampling temperature (only with `do_sample`)."""
    top_p: float = InferenceConfig.top_p
    """Nucleus sampling: keep the smallest set of tokens with this much probability; 1.0 keeps all."""
    top_k: int = InferenceConfig.top_k
    """Keep only the `top_k` most likely tokens when sampling; 0 keeps all."""
    repetition_penalty: float = InferenceConfig.repetition_penalty
    """Penalty on tokens already in the text; 1.0 is none."""
    seed: int | None = InferenceConfig.seed
    """Seed every rank samples with; rank 0 chooses one with :meth:`with_seed` when the user gave none."""
    want_scores: bool = False
    """Also return each generated token's probability and its most likely alternatives."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the reply; the reply (streamed and final) stops just before the first one."""
    template_options: dict[str, Any] = field(default_factory=dict)
    """Keywords for the chat template (`enable_thinking=False`, `reasoning_effort="low"`, `tools=[...]`)."""
    intervene: bool = True
    """The model's interventions (`%intervene`) apply to this reply (False: an HTTP client's, untouched)."""

    def __post_init__(self) -> None:
        _check_messages(self.messages)
        check_template_options(self.template_options)
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        _check(self.temperature > 0, f"temperature must be > 0, got {self.temperature}; use do_sample=False for greedy")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 keeps all tokens), got {self.top_k}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        wrong = check_sampling(self.do_sample, self.temperature, self.repetition_penalty, "use do_sample=False")
        _check(wrong is None, wrong)
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}")
        _check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a list of non-empty strings, got {self.stop!r}",
        )
        longest = max(map(len, self.stop), default=0)
        _check(
            longest <= MAX_STOP_CHARS,
            f"stop: each stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}",
        )

    def with_seed(self) -> GenerationRequest:
        """This request with a random seed filled in if it has none (rank 0 calls this before sending)."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(63))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationRequest:
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(valid))
        _check(not unknown, f"unknown generation request keys {unknown}; valid keys are {valid}")
        return cls(**data)


@dataclass(frozen=True)
class Alternative:
    """A token the model could have produced instead, with its probability."""

    token_id: int
    text: str
    prob: float


@dataclass(frozen=True)
class TokenScore:
    """A generated token with the probability it was drawn with and the most likely alternatives."""

    token_id: int
    text: str
    prob: float
    alternatives: list[Alternative]


@dataclass(frozen=True)
class GenerationResult:
    """What one rank's :func:`generate` produced (rank 0's is the reply; followers' match it unless interrupted)."""

    text: str
    """The reply, special tokens removed."""
    prompt_tokens: int
    """Tokens in the prompt built from the messages."""
    generated_tokens: int
    """Tokens this rank generated, an end-of-text token included."""
    finish_reason: str
    """"stop" (end-of-text token or a stop string), "length" (max_new_tokens or the context) or "interrupted"."""
    time_to_first_token_s: float
    """Seconds from the start of generation to the end of the prompt's forward pass."""
    tokens_per_s: float
    """Decoding speed after the first token: (generated_tokens - 1) / decoding seconds."""
    seed: int
    """The seed this rank sampled with."""
    scores: list[TokenScore] | None = None
    """Per-token probabilities and alternatives, when the request wanted them."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GenerationError(RuntimeError):
    """`model.generate` raised on this rank; the message names the rank and the cause is chained."""


class StopOnText(StoppingCriteria):
    """Stops generation on this rank once the reply's text contains one of `stops` (no set-up cost, unlike
    transformers' `stop_strings`, whose set-up grows with the stop strings' length on every rank).

    Each step decodes only the reply's last few tokens: enough to hold the longest stop string, which
    must end in the newest token if it was not found at an earlier step.
    """

    def __init__(self, tokenizer: Any, stops: list[str], num_prompt_tokens: int):
        self.tokenizer = tokenizer
        self.stops = stops
        self.num_prompt_tokens = num_prompt_tokens
        self.window = 4 * max(map(len, stops), default=0) + 16  # a character takes at most 4 byte tokens
        self.fired = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        if not self.fired:
            start = max(self.num_prompt_tokens, input_ids.shape[1] - self.window)
            text = reply_decoder(self.tokenizer)(input_ids[0, start:].tolist())
            self.fired = find_stop(text, self.stops) is not None
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


class SyncedStop(StoppingCriteria):
    """Ends generation on every rank at the same step: when any rank's `event` is set or any rank is done.

    A rank is done after its `max_new_tokens`, on one of `eos_ids` or on a stop string. `fired`
    says whether an interrupt (some rank's event) ended it. With `synced`, one all-reduce per step.
    """

    def __init__(
        self,
        event: threading.Event,
        *,
        prompt_tokens: int,
        max_new_tokens: int,
        eos_ids: list[int],
        stop_strings: StoppingCriteria | None = None,
        synced: bool = False,
    ):
        self.event, self.prompt_tokens, self.max_new_tokens = event, prompt_tokens, max_new_tokens
        self.eos_ids, self.stop_strings, self.synced = set(eos_ids), stop_strings, synced
        self.fired = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        done = input_ids.shape[1] - self.prompt_tokens >= self.max_new_tokens
        done = done or int(input_ids[0, -1]) in self.eos_ids
        if not done and self.stop_strings is not None:
            done = bool(self.stop_strings(input_ids, scores).any())
        flags = torch.tensor([int(self.event.is_set()), int(done)], dtype=torch.int64, device=input_ids.device)
        if self.synced:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.fired = self.fired or bool(flags[0])
        return torch.full((input_ids.shape[0],), bool(flags.any()), dtype=torch.bool, device=input_ids.device)

    def interrupted_everywhere(self, device: torch.device) -> bool:
        """Whether any rank's event is set (a collective when synced); remembered in `fired`."""
        flag = torch.tensor([int(self.event.is_set())], dtype=torch.int64, device=device)
        if self.synced:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.fired = self.fired or bool(flag[0])
        return self.fired


@dataclass
class _NoTokens:
    """What `generate` returns when interrupted before its first token: the prompt alone."""

    sequences: torch.Tensor
    scores: tuple = ()


def generate(
    model: Any,
    tokenizer: Any,
    request: GenerationRequest,
    *,
    device: torch.device | str,
    on_text: Callable[[str], None] | None,
    stop_event: threading.Event,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> GenerationResult:
    """Generate the reply to `request` on this rank; every rank of the job calls this with the same request.

    `on_text` receives the reply in whole-character chunks as it is generated (rank 0 passes
    it, followers pass None). Setting `stop_event` (a fresh one per request) stops this rank at
    the next step, and the interrupted reply is returned (rank 0's caller sets it when the user
    interrupts; generation runs in a worker thread there, out of KeyboardInterrupt's reach). If
    no step or token arrives for `timeout_s` seconds, TimeoutError is raised; an exception inside
    `model.generate` is raised as :class:`GenerationError`.
    """
    device = torch.device(device)
    prompt_ids, config = agree(lambda: plan_generation(model, tokenizer, request, device), PLAN_WORDS)
    synced = _world_size() > 1
    stop = SyncedStop(
        stop_event,
        prompt_tokens=prompt_ids.shape[1],
        max_new_tokens=config.max_new_tokens,
        eos_ids=_eos_ids(config, tokenizer),
        stop_strings=StopOnText(tokenizer, request.stop, prompt_ids.shape[1]) if request.stop else None,
        synced=synced,
    )
    # transformers stops only when SyncedStop says so, on every rank alike
    run_config = copy.deepcopy(config)
    run_config.update(
        eos_token_id=None, stop_strings=None, max_new_tokens=_largest(config.max_new_tokens, synced, device)
    )
    events: queue.Queue = queue.Queue()
    streamer = None
    if on_text is not None and request.stop:
        on_text = StopTextFilter(on_text, request.stop)
    if on_text is not None:
        streamer = TextDeltaStreamer(
            tokenizer, lambda text: events.put(("text", text)), decode=reply_decoder(tokenizer)
        )
    worker = _GenerateThread(
        model,
        events,
        device=device,
        seed=request.seed,
        stop=stop,
        kwargs=dict(
            inputs=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            generation_config=run_config,
            synced_gpus=synced,
            streamer=streamer,
            stopping_criteria=StoppingCriteriaList([stop]),
        ),
    )
    with _eval_mode(model), contextlib.ExitStack() as interventions:
        if not request.intervene:  # no row of this reply's forwards is intervened
            interventions.enter_context(applied_to(model, Rows((), 1, 1)))
        worker.start()
        with user_calls.serve_calls(lambda job: events.put(("call", job))):  # a follower's main thread runs them
            output = _consume(events, on_text, stop_event, timeout_s)
    if isinstance(on_text, StopTextFilter):
        on_text.close()
    return _result(tokenizer, request, config, output, prompt_ids.shape[1], stop.fired, worker)


def plan_generation(
    model: Any, tokenizer: Any, request: GenerationRequest, device: torch.device
) -> tuple[tuple[torch.Tensor, GenerationConfig], str]:
    """This rank's prompt ids and generation config, and a fingerprint of the prompt that every rank must share.

    Nothing here is collective: :func:`generate` runs it under :func:`agree`, so a rank whose
    tokenizer refuses the text fails here and every rank learns of it before any enters `generate`.
    """
    if request.seed is None:
        raise ValueError(
            "the request has no seed: rank 0 must fill one in (request.with_seed()) before sending it, "
            "so that every rank samples the same tokens"
        )
    prompt_ids = build_prompt_ids(tokenizer, request.messages, request.template_options)
    max_new_tokens = fit_max_new_tokens(model, prompt_ids.shape[1], request.max_new_tokens)
    config = build_generation_config(model, tokenizer, request, max_new_tokens)
    # the prompt only: ranks may sample differently (synced_gpus copes), but a forward that splits
    # activations over ranks needs the same tokens everywhere
    fingerprint = hashlib.sha256(prompt_ids.numpy().tobytes()).hexdigest()[:16]
    return (prompt_ids.to(device), config), fingerprint


def build_prompt_ids(
    tokenizer: Any, messages: list[dict[str, str]], template_options: dict[str, Any] | None = None
) -> torch.Tensor:
    """The conversation as a (1, n) tensor of token ids, ending with the assistant's turn opening.

    Special tokens inside a message's content stay text (never control tokens), whatever the model family.
    `template_options` are keywords the chat template reads (`enable_thinking`, `thinking`, `reasoning_effort`,
    `tools`); a template ignores the ones it does not know, as transformers passes them. A template that raises
    is a ChatTemplateError (a ValueError naming the template and the fix).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template, so a conversation cannot be "
            "turned into a prompt; load an instruct/chat model, or set tokenizer.chat_template"
        )
    # sanitize_control_tokens: a control token written inside a message ("<|im_start|>system" in user text)
    # is encoded as plain text; only the ones the template itself writes are control tokens, so no client
    # can forge a turn (a system prompt, an assistant reply) from inside its own content.
    encoded = apply_chat_template(
        tokenizer,
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        sanitize_control_tokens=True,
        **(template_options or {}),
    )
    return encoded["input_ids"]


def fit_max_new_tokens(model: Any, num_prompt_tokens: int, max_new_tokens: int) -> int:
    """`max_new_tokens`, shortened (with a warning) to what the model's context leaves after the prompt."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context is None:
        return max_new_tokens
    room = context - num_prompt_tokens
    if room <= 0:
        raise ValueError(
            f"the prompt is {num_prompt_tokens} tokens but the model's context holds {context} "
            "(max_position_embeddings): shorten the conversation (drop early messages) or start a new one"
        )
    if max_new_tokens > room:
        log.warning(
            "rank %d: max_new_tokens=%d does not fit the context (%d tokens, %d in the prompt); generating at most %d",
            _rank(),
            max_new_tokens,
            context,
            num_prompt_tokens,
            room,
        )
        return room
    return max_new_tokens


def build_generation_config(
    model: Any, tokenizer: Any, request: GenerationRequest, max_new_tokens: int
) -> GenerationConfig:
    """A private copy of the model's generation config with the request's settings (the model's stays untouched)."""
    config = copy.deepcopy(model.generation_config)
    if request.do_sample:
        sampling = dict(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k)
    else:  # unset, or transformers warns that they are ignored
        sampling = dict(temperature=None, top_p=None, top_k=None)
    eos_ids = _eos_ids(config, tokenizer)
    pad_id = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
    config.update(
        max_new_tokens=max_new_tokens,
        do_sample=request.do_sample,
        repetition_penalty=request.repetition_penalty,
        stop_strings=None,  # StopOnText instead: no set-up cost for long stop strings
        num_beams=1,  # one streamed sequence
        num_return_sequences=1,
        use_cache=True,
        return_dict_in_generate=True,
        output_scores=request.want_scores,
        eos_token_id=eos_ids or None,
        pad_token_id=pad_id if pad_id is not None else (eos_ids[0] if eos_ids else None),
        **sampling,
    )
    return config


class _GenerateThread(threading.Thread):
    """Runs `model.generate` on its own thread and reports each step, then its output or its exception, on `events`."""

    def __init__(
        self,
        model: Any,
        events: queue.Queue,
        *,
        device: torch.device,
        seed: int,
        kwargs: dict[str, Any],
        stop: SyncedStop | None = None,
    ):
        super().__init__(name="shardbook-generate", daemon=True)
        self.model = model
        self.stop = stop
        self.events = events
        self.device = device
        self.seed = seed
        self.kwargs = kwargs
        self.started_at = self.first_step_at = self.ended_at = 0.0

    def run(self) -> None:
        try:
            self.events.put(("done", self._generate()))
        except BaseException as exc:  # handed to the caller, which raises it with the rank
            self.events.put(("error", exc))

    def _generate(self) -> Any:
        set_current_device(self.device)
        hook = self.model.register_forward_hook(self._on_step)
        try:
            # no_grad, not inference_mode: with reshard_after_forward=False FSDP2 keeps the
            # unsharded parameters made here, and a later training step (fine-tuning in %%all)
            # then fails with "Inference tensors cannot be saved for backward" (measured).
            with _private_rng(self.device), torch.no_grad(), over_latents(self.model):  # in this thread's context
                torch.manual_seed(self.seed)
                self.started_at = time.perf_counter()
                cache = self._prefill_in_chunks()
                if cache is False:  # interrupted during the prefill: no token generated
                    self.ended_at = self.first_step_at = time.perf_counter()
                    return _NoTokens(self.kwargs["inputs"])
                if cache is not None:
                    self.kwargs[cache_keyword(self.model)] = cache
                    self.first_step_at = 0.0  # the first token comes from generate's forward
                output = self.model.generate(**self.kwargs)
                self.ended_at = time.perf_counter()
                return output
        finally:
            hook.remove()

    def _prefill_in_chunks(self) -> Any:
        """All but the last `PREFILL_CHUNK` prompt tokens forwarded in chunks into a cache that `generate` continues.

        Between chunks every rank checks for an interrupt together (a MAX all-reduce of the stop
        flags, when synced), so every rank stops after the same chunk. Returns the cache, None for a
        short prompt (nothing to chunk), False when interrupted.
        """
        ids = self.kwargs["inputs"]
        if ids.shape[1] <= PREFILL_CHUNK or self.stop is None:
            return None
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cut = ids.shape[1] - PREFILL_CHUNK  # generate's own forward takes the last chunk
        for start in range(0, cut, PREFILL_CHUNK):
            if self.stop.interrupted_everywhere(ids.device):
                return False
            end = min(start + PREFILL_CHUNK, cut)
            self.model(
                input_ids=ids[:, start:end],
                attention_mask=torch.ones_like(ids[:, :end]),
                **{cache_keyword(self.model): cache},
                use_cache=True,
                cache_position=torch.arange(start, end, device=ids.device),
            )
        if self.stop.interrupted_everywhere(ids.device):
            return False
        return cache

    def _on_step(self, module: Any, args: Any, output: Any) -> None:
        now = time.perf_counter()
        self.first_step_at = self.first_step_at or now
        self.events.put(("step", now))


def _consume(
    events: queue.Queue, on_text: Callable[[str], None] | None, stop_event: threading.Event, timeout_s: float
) -> Any:
    """Hand text to `on_text` until the generate thread ends; return its output or raise its error with the rank.

    If `on_text` raises, generation is stopped but still waited for (this rank keeps stepping
    with the others until all are done), then the error is raised.
    """
    sink_error: Exception | None = None
    while True:
        try:
            kind, value = events.get(timeout=timeout_s)
        except queue.Empty:
            stop_event.set()
            raise TimeoutError(
                f"rank {_rank()}: generation made no progress for {timeout_s:.0f} s; a peer rank may have died "
                "or left the collectives, so the process group is probably unusable: restart the kernel "
                "(raise the timeout if a single step of this model is really that slow)"
            ) from None
        if kind == "text" and on_text is not None and sink_error is None:
            try:
                on_text(value)
            except Exception as exc:
                sink_error = exc
                stop_event.set()
        elif kind == "call":  # a user function from the forward, run here where an interrupt reaches it
            value()
        elif kind == "error":
            raise GenerationError(f"rank {_rank()}: generation failed: {type(value).__name__}: {value}") from value
        elif kind == "done":
            if sink_error is not None:
                raise sink_error
            return value


def _result(
    tokenizer: Any,
    request: GenerationRequest,
    config: GenerationConfig,
    output: Any,
    num_prompt_tokens: int,
    interrupted: bool,
    worker: _GenerateThread,
) -> GenerationResult:
    token_ids = output.sequences[0, num_prompt_tokens:].tolist()
    text = reply_decoder(tokenizer)(token_ids)
    cut = find_stop(text, request.stop)
    if cut is not None or (token_ids and token_ids[-1] in (config.eos_token_id or [])):
        finish_reason = "stop"
    else:
        finish_reason = "interrupted" if interrupted else "length"
    decoding_s = worker.ended_at - worker.first_step_at
    return GenerationResult(
        text=text[:cut],
        prompt_tokens=num_prompt_tokens,
        generated_tokens=len(token_ids),
        finish_reason=finish_reason,
        time_to_first_token_s=worker.first_step_at - worker.started_at,
        tokens_per_s=(len(token_ids) - 1) / decoding_s if len(token_ids) > 1 and decoding_s > 0 else 0.0,
        seed=request.seed,
        scores=_token_scores(tokenizer, token_ids, output.scores) if request.want_scores else None,
    )


def _token_scores(tokenizer: Any, token_ids: list[int], scores: tuple[torch.Tensor, ...]) -> list[TokenScore]:
    """Each token's probability under the distribution it was drawn from, and the top alternatives there."""
    result = []
    for token_id, step_scores in zip(token_ids, scores):
        probs = torch.softmax(step_scores[0].float(), dim=-1)
        top = torch.topk(probs, k=min(NUM_ALTERNATIVES, probs.numel()))
        top_ids = top.indices.tolist()
        texts = tokenizer.batch_decode([[token_id]] + [[i] for i in top_ids], **DECODE_KWARGS)
        alternatives = [Alternative(i, t, p) for i, t, p in zip(top_ids, texts[1:], top.values.tolist())]
        result.append(TokenScore(token_id, texts[0], probs[token_id].item(), alternatives))
    return result


def _eos_ids(config: GenerationConfig, tokenizer: Any) -> list[int]:
    """The model's end-of-text ids plus the tokenizer's (a chat template's end-of-turn token)."""
    ids = config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """Put the model in eval mode (no dropout, no recomputation) for the block, with a warning if it was training."""
    was_training = model.training
    if was_training:
        log.warning("rank %d: the model was in training mode; generating in eval mode", _rank())
        model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _private_rng(device: torch.device) -> Iterator[None]:
    """Seeding inside this block leaves the caller's random state as it was."""
    devices = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _largest(value: int, synced: bool, device: torch.device) -> int:
    """The largest `value` of any rank (a collective when `synced`)."""
    if not synced:
        return value
    largest = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest.item())


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_messages(messages: Any) -> None:
    _check(isinstance(messages, list) and messages, "messages must be a non-empty list of {role, content} dicts")
    for i, message in enumerate(messages):
        ok = (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        )
        _check(ok, f"messages[{i}] must be a dict with string 'role' and 'content', got {message!r}")
        check_valid(message["content"], f"messages[{i}] ({message['role']!r})")
        check_valid(message["role"], f"messages[{i}]'s role")


RESERVED_TEMPLATE_KEYS = (
    "add_generation_prompt",
    "tokenize",
    "return_dict",
    "return_tensors",
    "sanitize_control_tokens",
)


def check_template_options(options: Any) -> None:
    """Template options are a dict of keyword names to JSON values, none of them one the prompt builder sets itself."""
    _check(isinstance(options, dict), f"template options must be a dict of keyword -> value, got {options!r}")
    for key in options:
        _check(isinstance(key, str) and key.isidentifier(), f"template option names must be identifiers, got {key!r}")
        _check(key not in RESERVED_TEMPLATE_KEYS, f"template option {key!r} is set by shardbook itself; drop it")


def _check(condition: Any, message: str) -> None:
    if not condition:
        raise ValueError(message)
