"""An engine stand-in for in-process app tests: every request yields one script."""

from __future__ import annotations

import asyncio

from helios_logprobs.runtime.engine.client import EngineInfo
from helios_logprobs.runtime.engine.engine import Engine as RealEngine


class ScriptedEngine:
    """Yields `script` (tokens, exceptions to raise, then Finished) for every request."""

    def __init__(self, script, *, k: int = 20, token_ids: bool = True) -> None:
        self.info = EngineInfo("scripted", 321, 64, k, token_ids, (0,))
        self.script = script
        self.alive = True
        self.requests = 0
        self.params = []
        self.prompt_ids = []
        """Every admitted request's SamplingParams and prompt ids, in order."""

    def check(self, prompt_ids, params) -> None:
        RealEngine.check(self, prompt_ids, params)

    async def generate(self, prompt_ids, params):
        self.check(prompt_ids, params)
        self.requests += 1
        self.params.append(params)
        self.prompt_ids.append(list(prompt_ids))
        for event in self.script:
            await asyncio.sleep(0)
            if isinstance(event, Exception):
                raise event
            yield event

    def healthy(self) -> bool:
        return self.alive
