//! A small working byte-level BPE vocabulary for synthetic models.
//!
//! The 256 byte tokens (GPT-2's byte-to-unicode mapping), merges learned
//! deterministically from an embedded English text, Qwen's special tokens, and
//! `[PADn]` filler (type UNUSED, as llama.cpp's converter pads) up to the model's
//! vocabulary size. Text prompts therefore tokenize with real merges in llama.cpp
//! and in samesum.

use std::collections::HashMap;

/// GGUF token types.
pub mod token_type {
    /// A normal token.
    pub const NORMAL: i32 = 1;
    /// A control token (`<|im_start|>` ...).
    pub const CONTROL: i32 = 3;
    /// A user-defined token (`<think>` ...).
    pub const USER_DEFINED: i32 = 4;
    /// A filler token.
    pub const UNUSED: i32 = 5;
}

/// The special tokens, in id order after the learned tokens.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Qwen3's user-defined tokens (matched whole, written out when decoded):
/// reasoning and tool-call markers.
pub const USER_DEFINED: [&str; 6] = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
];

/// A ChatML template in the form Qwen3's works: an optional system turn,
/// tools listed in the system turn as JSON lines inside `<tools>` with the
/// `<tool_call>` JSON form to answer in, assistant tool calls written in that
/// form, `tool` results as `<tool_response>` blocks in a user turn, and an
/// empty think block after the generation prompt when `enable_thinking` is
/// false. Without tools it renders plain ChatML.
pub const CHAT_TEMPLATE: &str = r#"{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nThese functions can be called. Their signatures, one JSON object a line, are inside <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nTo call one, answer with a JSON object of its name and arguments inside <tool_call></tool_call>:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\n' + message.content }}
{%- for call in message.tool_calls %}
{%- set f = call.function if call.function else call %}
{{- '\n<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"#;

const CORPUS: &str = include_str!("corpus.txt");

/// A vocabulary ready to be written to GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct Vocab {
    /// Token strings (byte-level encoded).
    pub tokens: Vec<String>,
    /// Token types.
    pub types: Vec<i32>,
    /// Merges, `"left right"`.
    pub merges: Vec<String>,
    /// `<|endoftext|>` id (bos, padding).
    pub eot: u32,
    /// `<|im_start|>` id.
    pub im_start: u32,
    /// `<|im_end|>` id (eos).
    pub im_end: u32,
}

/// GPT-2's reversible byte-to-unicode mapping.
pub fn byte_to_unicode() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        out[b as usize] = if printable {
            char::from_u32(b).expect("latin-1")
        } else {
            n += 1;
            char::from_u32(255 + n).expect("private offset")
        };
    }
    out
}

/// Split text the way the qwen2 pre-tokenizer roughly does for plain prose:
/// words carry their leading space; punctuation and digits stand alone.
fn pretokenize(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut prev_space = false;
    for ch in text.chars() {
        if ch.is_alphabetic() {
            if prev_space {
                cur.push(' ');
                prev_space = false;
            }
            cur.push(ch);
        } else {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            if ch == ' ' {
                prev_space = true;
            } else {
                prev_space = false;
                if !ch.is_whitespace() {
                    out.push(ch.to_string());
                }
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Build a vocabulary of exactly `size` tokens (at least 256 + specials).
pub fn build(size: u32) -> Vocab {
    let b2u = byte_to_unicode();
    let enc = |s: &str| -> Vec<String> { s.bytes().map(|b| b2u[b as usize].to_string()).collect() };
    let mut tokens: Vec<String> = (0..256).map(|b| b2u[b].to_string()).collect();
    let mut index: HashMap<String, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i))
        .collect();
    let budget = (size as usize)
        .saturating_sub(256 + SPECIALS.len() + USER_DEFINED.len())
        .min(4096);

    // Word frequencies, as sequences of symbols.
    let mut words: HashMap<Vec<String>, u32> = HashMap::new();
    for w in pretokenize(CORPUS) {
        *words.entry(enc(&w)).or_default() += 1;
    }
    let mut words: Vec<(Vec<String>, u32)> = words.into_iter().collect();
    words.sort();
    let mut merges = Vec::new();
    while merges.len() < budget {
        let mut pairs: HashMap<(String, String), u32> = HashMap::new();
        for (w, n) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0].clone(), p[1].clone())).or_default() += n;
            }
        }
        // Most frequent pair; ties broken by the pair's text, so training is deterministic.
        let Some(((a, b), count)) = pairs
            .into_iter()
            .max_by(|x, y| x.1.cmp(&y.1).then_with(|| y.0.cmp(&x.0)))
        else {
            break;
        };
        if count < 2 {
            break;
        }
        let joined = format!("{a}{b}");
        for (w, _) in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == a && w[i + 1] == b {
                    w[i] = joined.clone();
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
        merges.push(format!("{a} {b}"));
        if !index.contains_key(&joined) {
            index.insert(joined.clone(), tokens.len());
            tokens.push(joined);
        }
    }
    let mut types = vec![token_type::NORMAL; tokens.len()];
    let eot = tokens.len() as u32;
    for s in SPECIALS {
        tokens.push(s.to_string());
        types.push(token_type::CONTROL);
    }
    for s in USER_DEFINED {
        tokens.push(s.to_string());
        types.push(token_type::USER_DEFINED);
    }
    while tokens.len() < size as usize {
        tokens.push(format!("[PAD{}]", tokens.len()));
        types.push(token_type::UNUSED);
    }
    Vocab {
        tokens,
        types,
        merges,
        eot,
        im_start: eot + 1,
        im_end: eot + 2,
    }
}

/// The vocabulary size tiny shapes use.
pub const TINY_VOCAB: u32 = 512;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_is_consistent_and_deterministic() {
        let v = build(TINY_VOCAB);
        assert_eq!(v.tokens.len(), TINY_VOCAB as usize);
        assert_eq!(v.types.len(), v.tokens.len());
        assert!(
            v.merges.len() > 100,
            "only {} merges learned",
            v.merges.len()
        );
        let set: std::collections::HashSet<_> = v.tokens.iter().collect();
        assert_eq!(set.len(), v.tokens.len(), "duplicate tokens");
        for m in &v.merges {
            let (a, b) = m.split_once(' ').unwrap();
            assert!(
                set.contains(&format!("{a}{b}")),
                "merge result {a}{b} missing"
            );
            assert!(set.contains(&a.to_string()) && set.contains(&b.to_string()));
        }
        assert_eq!(v.tokens[v.im_end as usize], "<|im_end|>");
        assert_eq!(build(TINY_VOCAB), v);
        // A big vocabulary is padded, not retrained past the corpus.
        let big = build(151_936);
        assert_eq!(big.tokens.len(), 151_936);
        assert_eq!(big.types[151_935], token_type::UNUSED);
    }

    #[test]
    fn byte_mapping_is_a_bijection() {
        let m = byte_to_unicode();
        let set: std::collections::HashSet<_> = m.iter().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
    }
}
