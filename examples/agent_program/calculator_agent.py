"""A calculator agent written with the openai SDK only: what lit_cancel trains through its endpoint, unchanged.

It sends the problem (a record's ``prompt``, e.g. ``12345+67890=``) with one tool, ``calculate``; runs the tool calls
the model makes and sends their results back; and returns 1.0 when the model's final answer is the record's ``answer``.
Outside training it runs against any OpenAI-compatible server: ``await run(openai.AsyncOpenAI(base_url=...), record)``.
"""

import json

CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Adds the numbers of a sum.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12+30"}},
                       "required": ["expression"]},
    },
}


def calculate(expression: str) -> str:
    """The sum of ``expression`` (``a+b+...``), or what is wrong with it."""
    try:
        return str(sum(int(term) for term in expression.split("+")))
    except ValueError:
        return f"error: {expression!r} is not a sum of integers"


async def run(client, record: dict) -> float:
    messages = [{"role": "user", "content": record["prompt"]}]
    for _ in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATE], max_tokens=24)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == record["answer"])
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(arguments.get("expression", "")))})
    return 0.0
