from typing import TypedDict


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str
