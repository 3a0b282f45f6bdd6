//! Generated chat text split into what the OpenAI API returns separately:
//! the reasoning (`reasoning_content`), the answer (`content`) and the tool
//! calls (`tool_calls`), as Qwen models write them.
//!
//! - Reasoning: text between `<think>` and `</think>` at the start of the
//!   reply (Qwen3), or from the start when the prompt already opened the
//!   block (Qwen3-Next-Thinking and Qwen3.5 end their generation prompt with
//!   `<think>\n`), as llama-server's and vLLM's `deepseek` reasoning format.
//!   With the format `none` the text is returned as generated, tags and all.
//! - Tool calls: each `<tool_call>...</tool_call>` block, in Qwen3's JSON
//!   form (`{"name": ..., "arguments": {...}}`) or Qwen3.5's XML form
//!   (`<function=NAME><parameter=KEY>VALUE</parameter></function>`); a block
//!   that parses as neither, or is cut off, stays in the content as text.
//!
//! The splitter is incremental: text comes in as generated and pieces come
//! out as soon as they cannot be part of a tag still being written, so the
//! streamed deltas concatenate to the non-streamed fields exactly.
//! Whitespace between the parts (the `\n\n` after `</think>`, the newlines
//! around a tool call) is dropped, as llama-server does.

use serde_json::{Map, Value, json};

const THINK: &str = "<think>";
const END_THINK: &str = "</think>";
const CALL: &str = "<tool_call>";
const END_CALL: &str = "</tool_call>";

/// One part of the reply.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// Reasoning text.
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// A complete tool call.
    ToolCall {
        /// The function's name.
        name: String,
        /// Its arguments, as a JSON object's text.
        arguments: String,
    },
}

/// A tool the request offered: its name and the JSON types of its
/// parameters (to read Qwen3.5's XML values as the schema says).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tool {
    /// Function name.
    pub name: String,
    /// Parameter name to its schema `type` (`string`, `integer`, ...).
    pub params: Map<String, Value>,
}

impl Tool {
    /// The tools of an OpenAI `tools` array (entries that are not
    /// functions with a name are skipped; the request was validated).
    pub fn list(tools: &Value) -> Vec<Tool> {
        let mut out = Vec::new();
        for t in tools.as_array().into_iter().flatten() {
            let f = &t["function"];
            let Some(name) = f["name"].as_str() else {
                continue;
            };
            let params = f["parameters"]["properties"]
                .as_object()
                .map(|p| {
                    p.iter()
                        .map(|(k, v)| (k.clone(), v.get("type").cloned().unwrap_or(Value::Null)))
                        .collect()
                })
                .unwrap_or_default();
            out.push(Tool {
                name: name.to_string(),
                params,
            });
        }
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    /// Nothing but whitespace yet: a `<think>` may still open.
    Start,
    Reasoning,
    Content,
    Call,
}

/// The incremental splitter of one reply.
#[derive(Clone, Debug)]
pub struct Splitter {
    reasoning: bool,
    tools: Option<Vec<Tool>>,
    state: State,
    /// Text not yet given out (a tag may be starting in it, or whitespace
    /// that a following tag would drop).
    buf: String,
    /// Whether content has been given out (leading whitespace is dropped).
    content_started: bool,
    reasoning_started: bool,
    /// The whitespace before the tool call being read (given back with it
    /// if it turns out to be text).
    gap: String,
}

impl Splitter {
    /// A splitter: `reasoning` parses think blocks (the `deepseek` format),
    /// `think_open` when the prompt ended inside one; `tools` parses tool
    /// calls for these tools (`None`: the request offered none).
    pub fn new(reasoning: bool, think_open: bool, tools: Option<Vec<Tool>>) -> Splitter {
        Splitter {
            reasoning,
            tools,
            state: if !reasoning {
                State::Content
            } else if think_open {
                State::Reasoning
            } else {
                State::Start
            },
            buf: String::new(),
            content_started: false,
            reasoning_started: false,
            gap: String::new(),
        }
    }

    /// Whether this splitter does anything (else text passes through).
    pub fn active(&self) -> bool {
        self.reasoning || self.tools.is_some()
    }

    /// Add generated text; the pieces now certain.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drain(&mut out, false);
        out
    }

    /// The end of the reply: everything still held.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.drain(&mut out, true);
        out
    }

    fn emit_text(&mut self, out: &mut Vec<Piece>, text: &str, reasoning: bool) {
        let started = if reasoning {
            &mut self.reasoning_started
        } else {
            &mut self.content_started
        };
        let t = if *started { text } else { text.trim_start() };
        if t.is_empty() {
            return;
        }
        *started = true;
        let piece = if reasoning {
            Piece::Reasoning(t.to_string())
        } else {
            Piece::Content(t.to_string())
        };
        // Merge with the previous piece of the same kind.
        match (out.last_mut(), piece) {
            (Some(Piece::Reasoning(a)), Piece::Reasoning(b))
            | (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }

    fn drain(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            match self.state {
                State::Start => {
                    let t = self.buf.trim_start();
                    if t.starts_with(THINK) {
                        let skip = self.buf.len() - t.len() + THINK.len();
                        self.buf.drain(..skip);
                        self.state = State::Reasoning;
                    } else if !end && THINK.starts_with(t) {
                        // Only whitespace, or the start of `<think>`, so far.
                        return;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => match self.buf.find(END_THINK) {
                    Some(at) => {
                        let text = self.buf[..at].trim_end().to_string();
                        self.buf.drain(..at + END_THINK.len());
                        self.emit_text(out, &text, true);
                        self.state = State::Content;
                    }
                    None => {
                        let keep = if end {
                            0
                        } else {
                            held(&self.buf, &[END_THINK])
                        };
                        let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.emit_text(out, &text, true);
                        return;
                    }
                },
                State::Content => {
                    let call = self.tools.as_ref().and_then(|_| self.buf.find(CALL));
                    match call {
                        Some(at) => {
                            let text = self.buf[..at].trim_end().to_string();
                            self.gap = self.buf[text.len()..at].to_string();
                            self.buf.drain(..at);
                            self.emit_text(out, &text, false);
                            self.state = State::Call;
                        }
                        None => {
                            let tags: &[&str] = if self.tools.is_some() { &[CALL] } else { &[] };
                            let keep = if end { 0 } else { held(&self.buf, tags) };
                            let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                            let text = if end {
                                text.trim_end().to_string()
                            } else {
                                text
                            };
                            self.emit_text(out, &text, false);
                            return;
                        }
                    }
                }
                State::Call => match self.buf.find(END_CALL) {
                    Some(at) => {
                        let block = self.buf[CALL.len()..at].to_string();
                        let raw = self.buf[..at + END_CALL.len()].to_string();
                        self.buf.drain(..at + END_CALL.len());
                        match self.parse_call(&block) {
                            Some((name, arguments)) => {
                                out.push(Piece::ToolCall { name, arguments })
                            }
                            None => {
                                let raw = std::mem::take(&mut self.gap) + &raw;
                                self.emit_text(out, &raw, false);
                            }
                        }
                        self.gap.clear();
                        self.state = State::Content;
                    }
                    None if end => {
                        // Cut off: the text as generated.
                        let raw = std::mem::take(&mut self.gap) + &std::mem::take(&mut self.buf);
                        self.emit_text(out, raw.trim_end(), false);
                        return;
                    }
                    None => return,
                },
            }
        }
    }

    /// A tool call block's name and arguments (JSON object text).
    fn parse_call(&self, block: &str) -> Option<(String, String)> {
        let block = block.trim();
        if block.starts_with('{') {
            let v: Value = serde_json::from_str(block).ok()?;
            let name = v.get("name")?.as_str()?.to_string();
            let args = match v.get("arguments") {
                None | Some(Value::Null) => json!({}),
                Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok()?,
                Some(a) => a.clone(),
            };
            if !args.is_object() {
                return None;
            }
            return Some((name, args.to_string()));
        }
        // <function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...</function>
        let rest = block.strip_prefix("<function=")?;
        let (name, rest) = rest.split_once('>')?;
        let body = rest.trim().strip_suffix("</function>")?;
        let tool = self.tools.as_ref()?.iter().find(|t| t.name == name);
        let mut args = Map::new();
        let mut rest = body.trim();
        while !rest.is_empty() {
            let r = rest.strip_prefix("<parameter=")?;
            let (key, r) = r.split_once('>')?;
            let (value, r) = r.split_once("</parameter>")?;
            let value = value.strip_prefix('\n').unwrap_or(value);
            let value = value.strip_suffix('\n').unwrap_or(value);
            let ty = tool.and_then(|t| t.params.get(key)).and_then(Value::as_str);
            let v = match ty {
                Some("string") | None => match ty {
                    Some(_) => Value::String(value.to_string()),
                    // Unknown type: JSON when it reads as JSON, else text.
                    None => serde_json::from_str(value)
                        .unwrap_or_else(|_| Value::String(value.to_string())),
                },
                Some(_) => {
                    serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()))
                }
            };
            args.insert(key.to_string(), v);
            rest = r.trim_start();
        }
        Some((name.to_string(), Value::Object(args).to_string()))
    }
}

/// How many bytes at the end of `s` to hold back: whitespace (a tag after it
/// drops it) and the longest suffix that a tag in `tags` could start with.
fn held(s: &str, tags: &[&str]) -> usize {
    let mut k = 0;
    for tag in tags {
        for n in (1..tag.len()).rev() {
            if n <= s.len() && s.is_char_boundary(s.len() - n) && s.ends_with(&tag[..n]) {
                k = k.max(n);
                break;
            }
        }
    }
    let body = &s[..s.len() - k];
    let ws = body.len() - body.trim_end().len();
    k + ws
}

/// The whole reply at once: reasoning, content and tool calls.
pub fn split_all(s: &mut Splitter, text: &str) -> (String, String, Vec<(String, String)>) {
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    collect(pieces)
}

/// Pieces gathered into reasoning text, content text and tool calls.
pub fn collect(pieces: Vec<Piece>) -> (String, String, Vec<(String, String)>) {
    let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::new());
    for p in pieces {
        match p {
            Piece::Reasoning(t) => r.push_str(&t),
            Piece::Content(t) => c.push_str(&t),
            Piece::ToolCall { name, arguments } => calls.push((name, arguments)),
        }
    }
    (r, c, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Option<Vec<Tool>> {
        Some(Tool::list(
            &json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "days": {"type": "integer"}}}}}]),
        ))
    }

    /// Every way of cutting the text into streamed pieces gives what the
    /// whole text gives.
    fn check(
        reasoning: bool,
        open: bool,
        tools: Option<Vec<Tool>>,
        text: &str,
    ) -> (String, String, Vec<(String, String)>) {
        let whole = split_all(&mut Splitter::new(reasoning, open, tools.clone()), text);
        let chars: Vec<char> = text.chars().collect();
        for step in 1..=4 {
            let mut s = Splitter::new(reasoning, open, tools.clone());
            let mut pieces = Vec::new();
            for chunk in chars.chunks(step) {
                pieces.extend(s.push(&chunk.iter().collect::<String>()));
            }
            pieces.extend(s.finish());
            assert_eq!(collect(pieces), whole, "step {step}: {text:?}");
        }
        whole
    }

    #[test]
    fn think_blocks_become_reasoning() {
        let (r, c, t) = check(
            true,
            false,
            None,
            "<think>\nLet me see.\n</think>\n\nParis.",
        );
        assert_eq!(
            (r.as_str(), c.as_str(), t.len()),
            ("Let me see.", "Paris.", 0)
        );
        // Opened by the prompt.
        let (r, c, _) = check(true, true, None, "hm, 2+2\n</think>\n\n4");
        assert_eq!((r.as_str(), c.as_str()), ("hm, 2+2", "4"));
        // No think block: all content; a think tag later is content.
        let (r, c, _) = check(true, false, None, "Just <think> this");
        assert_eq!((r.as_str(), c.as_str()), ("", "Just <think> this"));
        // Cut off while thinking.
        let (r, c, _) = check(true, false, None, "<think>still going");
        assert_eq!((r.as_str(), c.as_str()), ("still going", ""));
        // Format none: as generated.
        let (r, c, _) = check(false, false, None, "<think>a</think>b");
        assert_eq!((r.as_str(), c.as_str()), ("", "<think>a</think>b"));
        // A partial tag at the end of the reply is text.
        let (_, c, _) = check(true, false, None, "<thi");
        assert_eq!(c, "<thi");
    }

    #[test]
    fn tool_calls_in_both_forms() {
        let text = "<think>need weather</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        let (r, c, t) = check(true, false, tools(), text);
        assert_eq!(r, "need weather");
        assert_eq!(c, "Checking.");
        assert_eq!(
            t,
            vec![
                ("get_weather".into(), r#"{"city":"Paris"}"#.into()),
                (
                    "get_weather".into(),
                    r#"{"city":"New York","days":3}"#.into()
                ),
            ]
        );
        // Unparsable or cut-off blocks stay as text; without tools, no parsing.
        let (_, c, t) = check(true, false, tools(), "<tool_call>\nnot json\n</tool_call>");
        assert_eq!(
            (c.as_str(), t.len()),
            ("<tool_call>\nnot json\n</tool_call>", 0)
        );
        let (_, c, t) = check(true, false, tools(), "a <tool_call>{\"name\": \"x\"");
        assert_eq!((c.as_str(), t.len()), ("a <tool_call>{\"name\": \"x\"", 0));
        let (_, c, t) = check(
            true,
            false,
            None,
            "<tool_call>{\"name\": \"x\"}</tool_call>",
        );
        assert_eq!(
            (c.as_str(), t.len()),
            ("<tool_call>{\"name\": \"x\"}</tool_call>", 0)
        );
    }
}
