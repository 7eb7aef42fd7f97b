"""Server configuration: one pydantic model whose field descriptions double as `loraplex serve --help`.

Knows nothing of how the values are used; the CLI builds its options from these fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ServerConfig(BaseModel):
    """Everything `loraplex serve` can be told; a typo in a key fails (extra="forbid")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- model and device
    model: str = Field("tiny", description="Base model: 'tiny' (built-in) or an HF model directory.")
    model_name: str | None = Field(
        None, description="Name reported to clients (get_info); default: the engine's own model name."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Compute device; auto = cuda if present."
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Fuse the decoder's elementwise math (RMSNorm, rope, SwiGLU, residual adds) with "
        "torch.compile; auto = on on CUDA. The first passes after start-up pay the compile (tens of "
        "seconds; cached across restarts in the inductor cache).",
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Replay each sampling decode step's forward as one CUDA graph per batch/span bucket; "
        "auto = on on CUDA for a dense model on one rank (on elsewhere is an error). Each bucket is "
        "captured at its first step; docs/OPERATIONS.md says what the graphs hold.",
    )
    max_slots: int = Field(
        8,
        ge=1,
        description="Adapters (training runs) resident at once; more runs than this take turns, the others "
        "waiting in host memory (--host-slots) or parked to disk.",
    )
    host_slots: int | None = Field(
        None,
        ge=0,
        description="Runs whose state waits in host memory (pinned on CUDA) when they give up their slot; "
        "beyond this, and for runs of finished or lapsed sessions, state is parked to disk. Default: as "
        "many max-rank slots as fit in half the host memory available at start-up; 0 = disk only.",
    )
    max_rank: int = Field(64, ge=1, description="Largest LoRA rank a run may ask for.")
    deterministic: bool = Field(
        False,
        description="Deterministic kernels: passes and sampling steps repeat bit for bit on one machine "
        "(slower on GPUs; docs/OPERATIONS.md says what repeats and what does not).",
    )

    # --- data parallelism (engine ranks; under torchrun the ranks come from its environment instead)
    nproc: int = Field(
        1,
        ge=1,
        description="Engine ranks on this machine, data parallel (one GPU each on CUDA); 1 = one engine "
        "in the server process.",
    )
    tp: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks per group: each group of T engine ranks splits the base model "
        "between them (by attention heads, MLP width and vocabulary), so a base T times larger fits; the "
        "--nproc ranks form --nproc / T data-parallel groups. T divides --nproc (or torchrun's world size) "
        "and the model's attention and KV heads; 1 = every rank holds the whole model.",
    )
    rank_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest an engine rank waits on another inside a collective before the server gives up "
        "and exits (a dead or hung rank is found within it).",
    )
    rank_start_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Longest the engine ranks wait for each other to start (join, load the base model, "
        "compare it) before giving up.",
    )

    # --- network and auth
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    auth: Literal["none", "keys"] = Field(
        "none", description="none: every key is the one local tenant; keys: only keys from `loraplex keys`."
    )
    allow_unauthenticated_remote: bool = Field(
        False,
        description="Serve --auth none on a --host other than loopback, where anyone who can reach the port "
        "acts as the one tenant; without it, serve refuses to start.",
    )

    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest a connection may take to send a request's headers (from its first byte, or "
        "from connecting); past it the server answers 408 and closes the connection.",
    )
    http_body_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest a request's body may stall between two pieces before the connection is closed.",
    )
    http_keep_alive_s: float = Field(
        20.0,
        gt=0,
        description="How long an idle connection is kept open for a client's next request (above the SDK's "
        "5 s pool expiry, so the client closes first).",
    )

    # --- storage
    data_dir: Path = Field(Path("./loraplex-data"), description="Checkpoints, snapshots and the SQLite file.")
    database_outage_s: float = Field(
        60.0,
        ge=0,
        description="How long a request waits for an unreachable database (tried again with backoff) "
        "before it is answered 503 with Retry-After; healthz answers 503 meanwhile.",
    )
    database_url: str | None = Field(
        None, description="SQLAlchemy URL (e.g. postgresql+psycopg://...); default: SQLite in the data dir."
    )

    # --- logs and metrics
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log lines on stderr: text (readable) or json (one object per line), one line per HTTP "
        "request included.",
    )
    log_level: Literal["debug", "info", "warning"] = Field(
        "info", description="Least severe log level shown; debug adds the engine loop's per-cycle summary."
    )
    metrics_public: bool = Field(
        False,
        description="Serve /metrics without an API key (for a Prometheus that cannot send one); without it, "
        "any tenant's key may read it. It names no tenant, run or sampler either way.",
    )

    # --- request limits (each rejected request fails alone, as a user error)
    max_datums_per_request: int = Field(4096, ge=1, description="Datums in one forward_backward request.")
    max_tokens_per_datum: int = Field(32768, ge=1, description="Tokens in one datum.")
    max_tokens_per_request: int = Field(
        1_000_000, ge=1, description="Tokens in one forward_backward request."
    )

    # --- admission limits (checked before anything is allocated for a request; a refusal names its limit)
    max_target_width: int = Field(
        128,
        ge=1,
        description="Widest K of 2-D (N, K) target_tokens and weights; top-K distillation needs K. Every "
        "datum of a pass is padded to the pass's widest K.",
    )
    max_topk_prompt_logprobs: int = Field(
        128,
        ge=0,
        description="Largest width per prompt position of an asample: topk_prompt_logprobs, "
        "prompt_alt_tokens_k and the K of target_prompt_logprobs (each result holds prompt length × K ids "
        "and logprobs); top-K distillation asks for K.",
    )
    max_topk_sample_logprobs: int = Field(
        128,
        ge=0,
        description="Largest topk_sample_logprobs of asample (its result holds num_samples × max_tokens × k "
        "ids and logprobs).",
    )
    max_sample_kv_mib: int = Field(
        8192,
        ge=1,
        description="Most KV cache (MiB) one asample may need, (prompt + max_tokens) × num_samples × the "
        "model's KV bytes per token; a larger request is refused.",
    )
    sample_kv_budget_mib: int = Field(
        32768,
        ge=1,
        description="Most KV cache (MiB) all running samples may hold together, in whole 16-token blocks; "
        "the cache's pool, allocated while any sample runs, holds it. A request past it waits for running "
        "ones to finish (one request alone always runs).",
    )
    max_json_body_mib: int = Field(
        8,
        ge=1,
        description="Largest JSON request body with a prompt (MiB): asample at ~8 bytes per token, /v1 "
        "completions. Other routes' JSON bodies may be 12 x --max-metadata-bytes + 64 KiB (every field is "
        "bounded); forward(_backward) bodies as large as --max-tokens-per-datum and --max-target-width need.",
    )
    max_metadata_entries: int = Field(64, ge=0, description="Entries of one user_metadata.")
    max_metadata_bytes: int = Field(
        16384,
        ge=0,
        description="Bytes of one user_metadata, its keys and values as UTF-8 text; also of a session's "
        "display name.",
    )
    max_stop_sequences: int = Field(32, ge=0, description="Items of one sampling_params.stop list.")
    max_stop_chars: int = Field(256, ge=1, description="Characters of one stop string.")
    max_name_bytes: int = Field(
        128,
        ge=1,
        description="Bytes (UTF-8) of a checkpoint or sampler name.",
    )

    # --- scheduling and leases
    pass_token_budget: int = Field(
        16384,
        ge=1,
        description="Tokens packed into one engine pass; a larger request runs as several passes of at most "
        "this many tokens (a longer datum alone), which bounds a pass's activation memory.",
    )
    pass_gather_quiet_ms: float = Field(
        25.0,
        ge=0,
        description="A pass waits for runs that trained recently but have sent nothing yet, while other "
        "passes keep arriving less than this apart (ms), so one step of many runs is one fused pass.",
    )
    pass_gather_max_ms: float = Field(
        100.0, ge=0, description="The longest a ready pass waits for other runs to join it (ms); 0 disables."
    )
    slot_wait_s: float = Field(
        2.0,
        ge=0,
        description="With more runs than slots, how long a run waits for a slot before a run with work "
        "ready, or holding gradients not yet stepped, is parked (gradients included) to make room for it.",
    )
    seq_gap_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Requests that waited this long behind a seq_id that never arrived (refused before it "
        "could be read, e.g. too large) fail, so the run goes on (s).",
    )
    max_seq_ids_ahead: int = Field(
        1024,
        ge=1,
        description="How far ahead of a run's next expected seq_id a request may be; further ones are "
        "refused.",
    )
    min_free_bytes: int | None = Field(
        None,
        ge=0,
        description="Free space (bytes) the data dir keeps: a save or park that would leave less is refused "
        "with a user error (try again once space is freed); default 4 GiB or 5 percent of the filesystem, "
        "whichever is less.",
    )
    max_queued_bytes_per_run: int = Field(
        2**30,
        ge=1,
        description="Bytes of requests one run may hold not yet executed (their decoded datums); past it a "
        "request answers 429 and the SDK resends later. The run's next expected request is always taken.",
    )
    max_prefill_tokens: int = Field(
        8192,
        ge=1,
        description="Prompt tokens the sampler prefills between two training passes (beyond the first "
        "prompt), so new prompts neither stall training nor the sequences already decoding.",
    )
    max_sampling_snapshots: int = Field(
        64,
        ge=1,
        description="Snapshots that sample at once: the entries of the sampler's snapshot pool, allocated at "
        "start at --max-rank on every adapted layer (docs/MEMORY.md); a request for another waits for one "
        "to be released, then the least recently used is evicted.",
    )
    sampler: Literal["loraplex", "vllm"] = Field(
        "loraplex",
        description="Where sampling requests are decoded: loraplex = this process's own sampler; vllm = vLLM "
        "OpenAI servers, given with --vllm-url or started by this server with --vllm-python (docs/VLLM.md).",
    )
    vllm_url: str | None = Field(
        None,
        description="--sampler vllm: the base URLs of running vLLM OpenAI servers of the same base model, "
        "comma-separated (requests are spread over them); each needs --enable-lora and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, and must read the snapshot directories under --data-dir.",
    )
    vllm_python: Path | None = Field(
        None,
        description="--sampler vllm: the python of an environment with vLLM (`make vllm` builds .venv-vllm); "
        "this server starts a vLLM server with it on the base model, restarts it if it dies or stalls, "
        "and stops it when it stops.",
    )
    vllm_snapshot_dir: str | None = Field(
        None,
        description="--sampler vllm: copy each snapshot into this directory before a vLLM server loads it, "
        "for servers that cannot see --data-dir: LOCAL (its path here) or LOCAL:REMOTE (REMOTE: the same "
        "directory as the servers see it). Default: servers load snapshots from the data dir itself.",
    )
    vllm_devices: str | None = Field(
        None,
        description="--vllm-python: one vLLM server per device group, e.g. '0,1;2,3' (CUDA ids; ';' between "
        "groups), each tensor-parallel over its group; requests are spread over them. Default: one server "
        "on the devices it sees.",
    )
    vllm_args: str = Field(
        "",
        description="--vllm-python: more arguments for the vLLM server, as one string (e.g. "
        "'--gpu-memory-utilization 0.5 --tensor-parallel-size 2').",
    )
    vllm_max_loras: int = Field(
        8,
        ge=1,
        description="--sampler vllm: snapshots loaded into each vLLM server at once (its --max-loras and "
        "--max-cpu-loras when this server starts it); past it the least recently used idle one is unloaded.",
    )
    vllm_timeout_s: float = Field(
        60.0,
        gt=0,
        description="--sampler vllm: a vLLM server that does not answer its health check this long is "
        "stalled: its requests fail (retryable) and, if this server started it, it is restarted.",
    )
    vllm_start_timeout_s: float = Field(
        900.0,
        gt=0,
        description="--vllm-python: longest a vLLM server may take to load the model and answer.",
    )
    max_queued_samples: int = Field(
        4096,
        ge=1,
        description="Samples queued or generating at once; past it asample answers 429 and the SDK resends.",
    )
    max_sampling_batch: int = Field(
        128,
        ge=1,
        description="Samples the sampler decodes at once (its batch's rows; one request's samples are never "
        "split, so also the most one asample may ask for); more wait, tenants taking turns.",
    )
    max_queued_samples_per_tenant: int | None = Field(
        None,
        ge=1,
        description="Samples one tenant may have queued or generating at once (429 past it); default: "
        "--max-queued-samples. Tenants take turns either way.",
    )
    future_retention_s: float = Field(
        86400.0,
        gt=0,
        description="How long a finished request's result stays retrievable (s); older ones are deleted.",
    )
    snapshot_idle_s: float = Field(
        3600.0,
        gt=0,
        description="An unnamed sampler snapshot (one per save_weights_and_get_sampling_client) unused this "
        "long is deleted with its sampler (s); also once its session ends or goes silent.",
    )
    metric_retention_s: float = Field(
        2_592_000.0,
        gt=0,
        description="A run's metric history (the console's charts) is deleted once the run has been unused "
        "this long (s).",
    )
    max_metrics_per_run: int = Field(
        100_000,
        ge=1,
        description="Metric records a run keeps (one per forward_backward, forward or optim_step); older "
        "ones are deleted.",
    )
    retention_sweep_s: float = Field(
        60.0, gt=0, description="How often expired results, checkpoints and snapshots are deleted (s)."
    )
    long_poll_s: float = Field(30.0, gt=0, description="How long retrieve_future holds before try_again.")
    session_timeout_s: float = Field(
        300.0, gt=0, description="Heartbeat silence after which a session's runs are parked to disk."
    )
    parked_retention_s: float = Field(
        604_800.0,
        gt=0,
        description="A run whose session finished or went silent, unused this long, loses its parked state "
        "(weights, optimizer moments, gradients: it can then be resumed from its named checkpoints only, "
        "which this never deletes); its row goes too if it has no checkpoints, and a session's row once it "
        "has no runs or samplers left (s).",
    )

    def resolved_database_url(self) -> str:
        """The database URL in use: the given one, else a SQLite file in the data directory."""
        return self.database_url or f"sqlite:///{(self.data_dir / 'loraplex.db').resolve()}"
