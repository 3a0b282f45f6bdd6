//! Structured output: `response_format` (`json_object`, `json_schema`), a
//! grammar, and forced tool calls (`tool_choice: "required"` or a named
//! function), as token constraints for the engine's sampler
//! ([`samesum_engine::constraint`]).
//!
//! Masks come from llguidance (the structured-output engine llama.cpp,
//! vLLM and SGLang also use): it compiles a JSON schema or a Lark grammar
//! lazily into a lexer and an Earley parser over the model's token trie and
//! computes each step's mask in well under a millisecond for a Qwen-sized
//! vocabulary, with no per-schema precompilation over the vocabulary
//! (outlines-core builds an index of every regex state against every token
//! up front, which costs seconds for a large schema and a 150k vocabulary;
//! a hand-written JSON automaton would cover JSON only, not schemas or
//! grammars). The constraint only masks sampling: the model's logits and
//! the reported log-probabilities are unchanged.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use samesum_engine::constraint::{Constraint, SharedConstraint};
use samesum_engine::tokenizer::Tokenizer;
use serde_json::{Value, json};
use std::sync::Arc;

/// What the output must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Format {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this schema (`json_schema.schema`).
    JsonSchema(Value),
    /// Text of this Lark grammar (llguidance's Lark dialect; the request's
    /// `grammar` field).
    Lark(String),
    /// One tool call in Qwen's JSON form, `<tool_call>{"name": ...,
    /// "arguments": {...}}</tool_call>`, to one of these tools (OpenAI
    /// `tools` entries), its arguments valid against the tool's
    /// `parameters`.
    ToolCall(Vec<Value>),
}

/// The vocabulary as llguidance sees it.
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }
}

/// Builds constraints for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// The token trie of `tok`: byte-level tokens as their bytes, added
    /// tokens (`<|im_end|>`, `<think>`, ...) as special tokens, which a
    /// grammar never produces unless it names them (their text still comes
    /// out of the byte tokens where a grammar asks for it).
    pub fn new(tok: &Tokenizer) -> Result<Grammars, String> {
        let n = tok.len() as u32;
        let words: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                if tok.is_added(i) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.token(i).as_bytes());
                    w
                } else {
                    tok.token_bytes(i)
                }
            })
            .collect();
        let eos = tok.stop.first().copied().unwrap_or(0);
        let trie = TokTrie::from(&TokRxInfo::new(n, eos), &words);
        let env: TokEnv = Arc::new(Env { trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A fresh constraint for `format`, or why it cannot be built (a 400).
    pub fn constraint(&self, format: &Format) -> Result<SharedConstraint, String> {
        let grammar = match format {
            Format::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"})))
            }
            Format::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Format::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Format::ToolCall(tools) => TopLevelGrammar::from_lark(tool_call_grammar(tools)?),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        Ok(SharedConstraint::new(Guided { m }))
    }
}

/// A grammar in llama.cpp's GBNF (`root ::= ...`) rewritten in
/// llguidance's Lark syntax; a grammar without `::=` is taken as Lark
/// already. Rules become `name: ...` (`-` in names becomes `_`, `root`
/// becomes `start`), character classes become regex terminals; strings,
/// grouping, alternatives, `*`, `+`, `?` and `{m,n}` mean the same in both.
/// A rule may continue over several lines, as in GBNF.
pub fn gbnf_to_lark(g: &str) -> String {
    if !g.contains("::=") {
        return g.to_string();
    }
    // One line per rule: a line holding `::=` starts one.
    let mut rules: Vec<String> = Vec::new();
    for line in g.lines() {
        let line = strip_comment(line);
        if line.trim().is_empty() {
            continue;
        }
        if line.contains("::=") || rules.is_empty() {
            rules.push(line.trim().to_string());
        } else if let Some(last) = rules.last_mut() {
            last.push(' ');
            last.push_str(line.trim());
        }
    }
    let mut out = String::new();
    for r in rules {
        let Some((name, body)) = r.split_once("::=") else {
            continue;
        };
        out.push_str(&rename(name.trim()));
        out.push_str(": ");
        out.push_str(&convert_body(body.trim()));
        out.push('\n');
    }
    out
}

fn rename(name: &str) -> String {
    if name == "root" {
        "start".into()
    } else {
        name.replace('-', "_").to_lowercase()
    }
}

/// `line` without a `#` comment (one outside a string or a class).
fn strip_comment(line: &str) -> &str {
    let (mut in_str, mut in_class, mut esc) = (false, false, false);
    for (i, c) in line.char_indices() {
        if esc {
            esc = false;
            continue;
        }
        match c {
            '\\' => esc = true,
            '"' if !in_class => in_str = !in_str,
            '[' if !in_str => in_class = true,
            ']' if !in_str => in_class = false,
            '#' if !in_str && !in_class => return &line[..i],
            _ => {}
        }
    }
    line
}

fn convert_body(body: &str) -> String {
    let chars: Vec<char> = body.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            // A string: copied as it is, escapes included.
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i = (i + 1).min(chars.len());
            out.extend(&chars[start..i]);
        } else if c == '[' {
            // A character class: a regex terminal.
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != ']' {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i = (i + 1).min(chars.len());
            let class: String = chars[start..i].iter().collect();
            out.push('/');
            out.push_str(&class.replace('/', "\\/"));
            out.push('/');
        } else if c.is_alphanumeric() || c == '_' || c == '-' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_alphanumeric() || chars[i] == '_' || chars[i] == '-')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            // Digits alone are a repeat count (`{2,5}`), not a rule.
            if word.chars().all(|c| c.is_ascii_digit()) {
                out.push_str(&word);
            } else {
                out.push_str(&rename(&word));
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `schema` with JSON written as Python's `json.dumps` writes it (`", "`
/// and `": "`, no other whitespace) unless the schema sets llguidance's
/// `x-guidance` options itself: free whitespace lets a model pad its
/// output with newlines and tabs until it runs out of tokens.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// A Lark grammar for one Qwen JSON-form tool call to one of `tools`.
fn tool_call_grammar(tools: &[Value]) -> Result<String, String> {
    let mut alts = Vec::new();
    for t in tools {
        let f = &t["function"];
        let name = f["name"].as_str().ok_or("a tool without a name")?;
        let params = match &f["parameters"] {
            Value::Null => json!({"type": "object"}),
            p => p.clone(),
        };
        alts.push(json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }));
    }
    let schema = compact(if alts.len() == 1 {
        alts.remove(0)
    } else {
        json!({"anyOf": alts})
    });
    Ok(format!(
        "start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}\n"
    ))
}

/// An llguidance matcher as the engine's constraint.
struct Guided {
    m: Matcher,
}

impl Constraint for Guided {
    fn mask(&mut self, allowed: &mut [bool]) -> Result<bool, String> {
        let vob = self.m.compute_mask().map_err(|e| e.to_string())?;
        for (t, a) in allowed.iter_mut().enumerate() {
            if *a && !vob.is_allowed(t as u32) {
                *a = false;
            }
        }
        self.m.is_accepting().map_err(|e| e.to_string())
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        self.m.consume_token(token).map_err(|e| e.to_string())
    }

    fn stopped(&self) -> bool {
        self.m.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use samesum_engine::constraint::{Step, step};

    fn tokenizer() -> Tokenizer {
        use samesum_synth::{SynthOptions, shapes, write_model};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        let opts = SynthOptions::new(
            shapes::by_name("tiny-qwen3moe").unwrap(),
            samesum_gguf::GgmlType::Q8_0,
            1,
        );
        write_model(&opts, &p, &mut |_, _| {}).unwrap();
        let f = samesum_gguf::GgufFile::open(&p).unwrap();
        Tokenizer::from_metadata(f.metadata()).unwrap()
    }

    /// Random walks through the masks (a seeded pick among the allowed
    /// tokens each step) always produce text that parses and validates.
    #[test]
    fn random_walks_under_a_schema_give_valid_json() {
        let tok = tokenizer();
        let g = Grammars::new(&tok).unwrap();
        let schema = json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "kind": {"enum": ["cat", "dog"]},
            "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}},
            "required": ["name", "kind", "tags", "inner"], "additionalProperties": false});
        let mut rng = samesum_quant::rng::Rng::new(5);
        for walk in 0..20 {
            let c = g.constraint(&Format::JsonSchema(schema.clone())).unwrap();
            let mut ids = Vec::new();
            let mut ended = false;
            for _ in 0..400 {
                let mut guard = c.0.lock().unwrap();
                match step(&mut **guard, tok.len(), &tok.stop) {
                    Step::End => {
                        ended = true;
                        break;
                    }
                    Step::Sample(a) => {
                        let ok: Vec<u32> = (0..a.len() as u32).filter(|&t| a[t as usize]).collect();
                        // Prefer ending once allowed, to keep walks short.
                        let t = match ok.iter().find(|t| tok.stop.contains(t)) {
                            Some(&s) if rng.below(2) == 0 => s,
                            _ => ok[rng.below(ok.len() as u64) as usize],
                        };
                        if tok.stop.contains(&t) {
                            ended = true;
                            break;
                        }
                        guard.commit(t).unwrap();
                        ids.push(t);
                    }
                }
            }
            assert!(ended, "walk {walk} did not end");
            let text = tok.decode(&ids).unwrap();
            let v: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("walk {walk}: {text:?}: {e}"));
            assert!(v["name"].as_str().unwrap().chars().count() <= 8, "{text}");
            assert!(
                ["cat", "dog"].contains(&v["kind"].as_str().unwrap()),
                "{text}"
            );
            assert!(
                v["tags"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|x| x.as_f64().is_some_and(|f| f.fract() == 0.0)),
                "{text}"
            );
            assert!(v["inner"]["ok"].is_boolean(), "{text}");
            assert_eq!(v.as_object().unwrap().len(), 4, "{text}");
        }
    }

    /// Walk a constraint with seeded random picks until it ends; the text.
    fn walk(tok: &Tokenizer, c: &SharedConstraint, seed: u64) -> String {
        let mut rng = samesum_quant::rng::Rng::new(seed);
        let mut ids = Vec::new();
        for _ in 0..600 {
            let mut guard = c.0.lock().unwrap();
            let Step::Sample(a) = step(&mut **guard, tok.len(), &tok.stop) else {
                break;
            };
            let ok: Vec<u32> = (0..a.len() as u32).filter(|&t| a[t as usize]).collect();
            let t = match ok.iter().find(|t| tok.stop.contains(t)) {
                Some(&s) if rng.below(2) == 0 => s,
                _ => ok[rng.below(ok.len() as u64) as usize],
            };
            if tok.stop.contains(&t) {
                break;
            }
            guard.commit(t).unwrap();
            ids.push(t);
        }
        tok.decode(&ids).unwrap()
    }

    #[test]
    fn gbnf_grammars_and_tool_calls_constrain_the_text() {
        let tok = tokenizer();
        let g = Grammars::new(&tok).unwrap();
        let gbnf = "# a yes/no answer and a list\nroot ::= answer \" \" list\nanswer ::= \"yes\" | \"no\"\nlist ::= \"[\" item (\",\" item){0,2} \"]\"\nitem ::= [a-c]+ # letters\n";
        let lark = gbnf_to_lark(gbnf);
        assert!(lark.starts_with("start: answer"), "{lark}");
        for seed in 0..10 {
            let c = g.constraint(&Format::Lark(lark.clone())).unwrap();
            let text = walk(&tok, &c, seed);
            let (ans, list) = text.split_once(' ').unwrap_or_else(|| panic!("{text:?}"));
            assert!(ans == "yes" || ans == "no", "{text:?}");
            let inner = list
                .strip_prefix('[')
                .and_then(|l| l.strip_suffix(']'))
                .unwrap();
            let items: Vec<&str> = inner.split(',').collect();
            assert!((1..=3).contains(&items.len()), "{text:?}");
            assert!(
                items
                    .iter()
                    .all(|i| !i.is_empty() && i.chars().all(|c| ('a'..='c').contains(&c))),
                "{text:?}"
            );
        }
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"], "additionalProperties": false}}}),
        ];
        for seed in 0..10 {
            let c = g.constraint(&Format::ToolCall(tools.clone())).unwrap();
            let text = walk(&tok, &c, seed);
            let mut s = crate::chat_output::Splitter::new(
                false,
                false,
                Some(crate::chat_output::Tool::list(&json!(tools))),
            );
            let (_, content, calls) = crate::chat_output::split_all(&mut s, &text);
            assert_eq!((content.as_str(), calls.len()), ("", 1), "{text:?}");
            assert_eq!(calls[0].0, "get_weather");
            let args: Value = serde_json::from_str(&calls[0].1).unwrap();
            assert!(
                args["city"].as_str().unwrap().chars().count() <= 6,
                "{text:?}"
            );
        }
    }

    #[test]
    fn bad_schemas_and_grammars_are_errors() {
        let tok = tokenizer();
        let g = Grammars::new(&tok).unwrap();
        assert!(g.constraint(&Format::Lark("start: (".into())).is_err());
        assert!(
            g.constraint(&Format::JsonSchema(json!({"type": "nonsense"})))
                .is_err()
        );
        assert!(
            g.constraint(&Format::ToolCall(vec![json!({"function": {}})]))
                .is_err()
        );
    }
}
