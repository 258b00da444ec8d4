"""An answer as Responses output items, built as it streams, with the events each step emits.

Items come in the order the model writes them: a ``reasoning`` item (its ``reasoning_text``), a
``message`` with one ``output_text`` part, then one ``function_call`` per call. Each item opens with
``response.output_item.added`` (and ``content_part.added``), grows with ``*.delta`` events and
closes with ``*.done`` events when the next one opens or the answer ends. The same builder, fed the
whole answer at once, makes the non-streamed ``output``; its events are then dropped.
"""

import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # finished and open items, as in ``Response.output``
        self.events: list[dict[str, Any]] = []  # waiting to be sent; without ``sequence_number``
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # the chat tool-call index -> its item

    @property
    def content(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [i for i in self.items if i["type"] == "function_call"]

    def reasoning(self, text: str) -> None:
        if not text:
            return
        item = self._item("reasoning")
        item["content"][0]["text"] += text
        self._event("response.reasoning_text.delta", item, content_index=0, delta=text)

    def text(self, text: str) -> None:
        if not text:
            return
        item = self._item("message")
        item["content"][0]["text"] += text
        self._event("response.output_text.delta", item, content_index=0, delta=text, logprobs=[])

    def tool_call(self, delta: dict[str, Any]) -> None:
        """One chat tool-call delta: the first of a call names it, later ones add to its arguments."""
        function = delta.get("function") or {}
        item = self._calls.get(delta["index"])
        if item is None:
            self._close()
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": delta.get("id") or new_id("call"), "name": function.get("name", ""), "arguments": ""}
            self._open_item(item)
            self._calls[delta["index"]] = item
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            self._event("response.function_call_arguments.delta", item, delta=arguments)

    def finish(self, status: str) -> None:
        """Close the open item; every item ends with ``status`` ("completed" or "incomplete")."""
        self._close(status)

    def _item(self, kind: str) -> dict[str, Any]:
        if self._open is not None and self._open["type"] == kind:
            return self._open
        self._close()
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self._open_item(item)
        return item

    def _open_item(self, item: dict[str, Any]) -> None:
        self._open = item
        self.items.append(item)
        shown = {**item, "content": []} if "content" in item else dict(item)
        self.events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                            "item": shown})
        if "content" in item:
            part = {**item["content"][0], "text": ""}
            self._event("response.content_part.added", item, content_index=0, part=part)

    def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "function_call":
            self._event("response.function_call_arguments.done", item, name=item["name"], arguments=item["arguments"])
        else:
            part = dict(item["content"][0])
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if kind == "output_text" else {}
            self._event(f"response.{kind}.done", item, content_index=0, text=part["text"], **extra)
            self._event("response.content_part.done", item, content_index=0, part=part)
        self.events.append({"type": "response.output_item.done", "output_index": self.items.index(item),
                            "item": dict(item)})

    def _event(self, kind: str, item: dict[str, Any], **fields: Any) -> None:
        self.events.append({"type": kind, "item_id": item["id"], "output_index": self.items.index(item), **fields})
