"""POST /v1/completions."""

from __future__ import annotations

from dataclasses import replace

from pydantic import Field, field_validator, model_validator

from app.api.schemas.common import MAX_N, MAX_PROMPT_CHARS, Generation, TokenId, utf8
from app.api.schemas.sampling import SamplingBody
from app.sampling.params import MAX_LOGPROBS

MAX_PROMPTS = 32  # prompts in one completions request
MAX_CHOICES = 64  # prompts x n


class CompletionRequest(SamplingBody):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description=f"A prompt (text or token ids) or up to {MAX_PROMPTS} of them; choice index = prompt * n + j.")
    echo: bool = Field(default=False, description="Return the prompt before the completion (and its logprobs).")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                 description="The sampled token's logprob and the k likeliest (raw logits).")
    suffix: str | None = Field(default=None, description="Refused: insertion is not implemented.")
    best_of: int | None = Field(default=None, ge=1, le=MAX_N, description="Refused unless equal to n.")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not prompts:
            raise ValueError("prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed, got {len(prompts)}")
        for p in prompts:
            if isinstance(p, str) and len(p) > MAX_PROMPT_CHARS:
                raise ValueError(f"a prompt has {len(p)} characters; the limit is {MAX_PROMPT_CHARS}")
            if not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p, str):
                utf8(p, "prompt")
        return prompt

    @model_validator(mode="after")
    def _limits(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 only with echo)")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts())} prompts x n={self.n} is more than {MAX_CHOICES} choices")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    def _refused(self, name, value):
        if name == "suffix" and value:
            return "insertion (fill-in-the-middle) is not implemented"
        if name == "best_of" and value not in (None, self.n):
            return f"best_of ({value}) must equal n ({self.n}); ranking extra samples is not implemented"
        return None

    def generation(self, default_max_tokens: int) -> Generation:
        params = self.sampling_params(default_max_tokens)
        params = replace(params, logprobs=self.logprobs,
                         prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None)
        return Generation(params, self.n, self.echo, self.logprobs, self.stream, self.include_usage)

