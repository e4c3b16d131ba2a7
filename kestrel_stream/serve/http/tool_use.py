"""What a chat generation does with tools: the prompt that offers them (text/tool_prompt.py), the grammar that
forces a call where tool_choice asks for one, and a parser per choice that reads the calls back out of the
text (text/tool_calls.py), in the call format the model's template teaches."""
from __future__ import annotations

from kestrel_stream.serve.http.errors import APIError
from kestrel_stream.serve.http.requests import TextRequest
from kestrel_stream.text.grammar import Constraint, GrammarError
from kestrel_stream.text.tool_calls import ToolCallParser, call_format, forced_grammar
from kestrel_stream.text.tool_prompt import render_tool_chat, uses_tools


class ToolUse:
    def __init__(self, request: TextRequest, tokenizer):
        self.request, self.tokenizer = request, tokenizer
        self.tools = request.tools
        self.format = call_format(tokenizer.chat_template)

    @staticmethod
    def of(request: TextRequest, tokenizer) -> "ToolUse | None":
        """None for a request that neither offers tools nor holds tool calls or results."""
        if not request.chat or tokenizer is None or not tokenizer.chat_template:
            return None
        if request.tools is None and not uses_tools(request.prompt):
            return None
        return ToolUse(request, tokenizer)

    @property
    def offers_tools(self) -> bool:
        """Tools are shown to the model (offered, and tool_choice is not "none")."""
        return self.tools is not None and bool(self.tools.offered)

    def prompt(self) -> str:
        """The prompt text (ChatTemplateError from the template)."""
        offered = [t.as_template() for t in self.tools.offered] if self.offers_tools else None
        return render_tool_chat(self.tokenizer, self.request.prompt, offered)

    def constraint(self, grammars, vocab_size: int) -> Constraint | None:
        """The grammar of a forced call (tool_choice required or a function), or of a call or the
        response_format's document (tool_choice auto with a response_format); None: the answer is free."""
        tools, fmt = self.tools, self.request.response_format
        if not self.offers_tools or not (tools.forced_call or fmt is not None):
            return None
        callable_ = list(tools.callable)
        text_schema = fmt.schema if fmt is not None else None
        try:
            return grammars.lark(forced_grammar(self.format, callable_, tools.parallel, text_schema,
                                                optional=not tools.forced_call), vocab_size)
        except GrammarError as e:
            for i, tool in enumerate(tools.tools):      # name the tool whose schema the compiler refuses
                try:
                    grammars.lark(forced_grammar(self.format, [tool], False), vocab_size)
                except GrammarError as alone:
                    raise APIError(400, f"tools[{i}].function.parameters: {alone}",
                                   param=f"tools[{i}].function.parameters") from None
            raise APIError(400, f"response_format.json_schema.schema: {e}",
                           param="response_format.json_schema.schema") from None

    def parser(self) -> ToolCallParser | None:
        """A choice's reader of calls; None where no tool is offered (tool_choice none)."""
        if not self.offers_tools:
            return None
        return ToolCallParser(self.format, frozenset(t.name for t in self.tools.callable),
                              None if self.tools.parallel else 1)
