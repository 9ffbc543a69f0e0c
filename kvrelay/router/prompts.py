"""Prompts from requests: completions' text or token ids, chats through the chat template,
tokenized off the event loop (``text_workers``), with vLLM's ``truncate_prompt_tokens`` and
the context window's 400s."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.router.backend import Backend
from kvrelay.router.errors import bad_request
from kvrelay.router.request_models import ChatCompletionRequest, context_length_error
from kvrelay.router.responses import PromptInfo
from kvrelay.router.structured import ToolPlan, plan_tools
from kvrelay.router.text_workers import PromptTooLong, TextWorkers
from kvrelay.text.tokenizer import Tokenizer, TokenizerError
from kvrelay.text.tool_parsers import ToolParser


@dataclass(slots=True)
class Prompts:
    tokenizer: Tokenizer
    text: TextWorkers
    backend: Backend  # its max_model_len is the context window
    tool_parser: ToolParser | None  # plans tools for /tokenize's chats

    def tokens_kept(self, truncate: int | None) -> int | None:
        """vLLM's ``truncate_prompt_tokens``: how many of a prompt's last tokens are kept
        (-1: the context window), None to keep them all."""
        limit = self.backend.max_model_len
        if truncate is None:
            return None
        if truncate == -1:
            return limit
        if not 1 <= truncate <= limit:
            raise bad_request(
                f"'truncate_prompt_tokens' must be -1 (the context window) or in [1, {limit}]"
                f" (the context window), got {truncate}",
                "truncate_prompt_tokens",
            )
        return truncate

    async def completion(
        self,
        prompt: str | list[int],
        echo: bool,
        add_special: bool,
        keep: int | None,
        param: str = "prompt",
    ) -> PromptInfo:
        """One prompt (text or token ids) checked and tokenized; 400s name ``param``."""
        if not prompt:
            raise bad_request(f"'{param}' must not be empty", param)
        if isinstance(prompt, str):
            info = PromptInfo(await self.encode(prompt, add_special, param, keep), prompt)
            return self.truncated(info, keep)
        bad = next((t for t in prompt if not 0 <= t < self.tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"{param} token id {bad} is outside the vocabulary "
                f"[0, {self.tokenizer.vocab_size})",
                param,
            )
        ids = list(prompt) if keep is None else list(prompt[-keep:])
        text = self.tokenizer.decode(ids, skip_special_tokens=False) if echo else ""
        return PromptInfo(ids, text)

    def truncated(self, prompt: PromptInfo, keep: int | None) -> PromptInfo:
        """The prompt's last ``keep`` tokens, with their text (what echo gives back)."""
        if keep is None or len(prompt.token_ids) <= keep:
            return prompt
        ids = prompt.token_ids[-keep:]
        return PromptInfo(ids, self.tokenizer.decode(ids, skip_special_tokens=False))

    async def chat(self, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> PromptInfo:
        """The request's messages through the chat template, tokenized (``tools``: the plan
        of its ``tools`` / ``tool_choice``; made here when not given, as for /tokenize)."""
        if tools is None:
            tools = plan_tools(
                req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser
            )
        messages = [m.to_template() for m in req.messages]
        try:
            text = await self.text.apply_chat_template(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=list(tools.tools) or None,
                chat_template=req.chat_template,
                **(req.chat_template_kwargs or {}),
            )
        except TokenizerError as exc:
            param = "chat_template" if req.chat_template is not None else "messages"
            raise bad_request(str(exc), param) from exc
        except RecursionError:
            raise bad_request("the messages are nested too deeply", "messages") from None
        if req.continue_final_message:
            text = cut_after_final_message(text, req.messages[-1].text)
        keep = self.tokens_kept(req.truncate_prompt_tokens)
        ids = await self.encode(text, bool(req.add_special_tokens), "messages", keep)
        return self.truncated(PromptInfo(ids, text), keep)

    async def encode(
        self, text: str, add_special_tokens: bool, param: str, keep: int | None = None
    ) -> list[int]:
        """The text's token ids; a 400 naming ``param`` when they fill the context window,
        unless only the last ``keep`` are kept (``truncate_prompt_tokens``)."""
        limit = self.backend.max_model_len if keep is None else None
        try:
            return await self.text.encode(text, add_special_tokens, limit)
        except PromptTooLong as exc:  # what resolve_max_tokens says, without the ids
            raise context_length_error(
                exc.num_tokens, self.backend.max_model_len, None, param
            ) from None
        except (TokenizerError, UnicodeError) as exc:
            raise bad_request(f"cannot tokenize the {param}: {exc}", param) from exc


def cut_after_final_message(rendered: str, final_text: str) -> str:
    """The rendered chat up to the end of the final message (for continue_final_message)."""
    end = rendered.rfind(final_text) if final_text else -1
    if end == -1:
        raise bad_request(
            "cannot continue the final message: its content is empty or not in the rendered chat",
            "continue_final_message",
        )
    return rendered[: end + len(final_text)]
