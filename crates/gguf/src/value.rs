//! Metadata values: the GGUF value types, arrays (including arrays of arrays), and
//! the key/value map with typed getters that report the key and the type found.

use crate::error::{GgufError, Result};
use std::collections::HashMap;
use std::fmt;

/// The on-disk GGUF value type tag.
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The value type with tag `id`, if any.
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The smallest number of bytes one value of this type takes on disk
    /// (used to bound counts before allocating).
    pub fn min_encoded_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String => 8,
            Array => 12,
        }
    }

    /// Lower-case name as used in error messages (`u32`, `string`, `array`...).
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An array value: its element type (kept even when empty) and its items.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    /// The declared element type; every item has this type.
    pub elem_type: ValueType,
    /// The items.
    pub items: Vec<Value>,
}

/// One metadata value.
#[allow(missing_docs)]
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// A type description for errors: `u32`, or `array[string]` for arrays.
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(a) => match a.items.first() {
                Some(first @ Value::Array(_)) => format!("array[{}]", first.type_description()),
                _ => format!("array[{}]", a.elem_type),
            },
            v => v.value_type().name().to_string(),
        }
    }

    /// The value as a non-negative integer of any integer type.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer of any integer type.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v as i64),
            Value::U16(v) => Some(v as i64),
            Value::U32(v) => Some(v as i64),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a float (f32 or f64 only).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(v) => write!(f, "{v:?}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Array(a) => {
                const SHOW: usize = 8;
                write!(f, "[")?;
                for (i, item) in a.items.iter().take(SHOW).enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{item}")?;
                }
                if a.items.len() > SHOW {
                    write!(f, ", ... ({} items)", a.items.len())?;
                }
                write!(f, "]")
            }
        }
    }
}

macro_rules! from_scalar {
    ($($t:ty => $v:ident),*) => {$(
        impl From<$t> for Value {
            fn from(x: $t) -> Self { Value::$v(x) }
        }
    )*};
}
from_scalar!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::String(s.to_string())
    }
}

impl Value {
    /// An array of `elem_type` from items (the caller keeps the items homogeneous;
    /// the writer checks it).
    pub fn array(elem_type: ValueType, items: Vec<Value>) -> Value {
        Value::Array(Array { elem_type, items })
    }

    /// An array of strings.
    pub fn string_array<S: Into<String>>(items: impl IntoIterator<Item = S>) -> Value {
        Value::array(
            ValueType::String,
            items.into_iter().map(|s| Value::String(s.into())).collect(),
        )
    }
}

/// The metadata section: keys in file order, with lookup by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

macro_rules! getter {
    ($(#[$doc:meta] $name:ident -> $t:ty, $variant:ident, $tname:literal;)*) => {$(
        #[$doc]
        pub fn $name(&self, key: &str) -> Result<$t> {
            match self.require(key)? {
                Value::$variant(v) => Ok(v.clone()),
                other => Err(GgufError::WrongType {
                    key: key.to_string(),
                    expected: $tname.to_string(),
                    found: other.type_description(),
                }),
            }
        }
    )*};
}

impl Metadata {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Insert a value; a repeated key is an error naming it.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Result<()> {
        let key = key.into();
        if self.index.contains_key(&key) {
            return Err(GgufError::DuplicateKey { key });
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value.into()));
        Ok(())
    }

    /// Insert or replace a value, keeping the key's original position.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<Value>) {
        let key = key.into();
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value.into(),
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value.into()));
            }
        }
    }

    /// The entries in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value under `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// The value under `key`, or an error naming the missing key.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::KeyNotFound {
            key: key.to_string(),
        })
    }

    getter! {
        /// A `u8` value.
        get_u8 -> u8, U8, "u8";
        /// An `i8` value.
        get_i8 -> i8, I8, "i8";
        /// A `u16` value.
        get_u16 -> u16, U16, "u16";
        /// An `i16` value.
        get_i16 -> i16, I16, "i16";
        /// A `u32` value.
        get_u32 -> u32, U32, "u32";
        /// An `i32` value.
        get_i32 -> i32, I32, "i32";
        /// A `u64` value.
        get_u64 -> u64, U64, "u64";
        /// An `i64` value.
        get_i64 -> i64, I64, "i64";
        /// An `f32` value.
        get_f32 -> f32, F32, "f32";
        /// An `f64` value.
        get_f64 -> f64, F64, "f64";
        /// A `bool` value.
        get_bool -> bool, Bool, "bool";
    }

    /// A string value, borrowed.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            other => Err(self.wrong(key, "string", other)),
        }
    }

    /// Any non-negative integer value (u8..u64, or a non-negative signed one), as u64.
    /// Converters are not consistent about integer widths; readers of hyperparameters
    /// should use this.
    pub fn get_uint(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong(key, "unsigned integer", v))
    }

    /// Any float value (f32 or f64), as f64.
    pub fn get_float(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| self.wrong(key, "float", v))
    }

    /// An array value, borrowed.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            other => Err(self.wrong(key, "array", other)),
        }
    }

    /// An array of strings, borrowed.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let a = self.get_array(key)?;
        a.items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                _ => Err(self.wrong(key, "array[string]", &Value::Array(a.clone()))),
            })
            .collect()
    }

    /// An array of integers of any integer type, as i64.
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>> {
        let a = self.get_array(key)?;
        a.items
            .iter()
            .map(|v| {
                v.as_i64()
                    .ok_or_else(|| self.wrong(key, "array[integer]", &Value::Array(a.clone())))
            })
            .collect()
    }

    /// An array of floats (f32/f64), as f64.
    pub fn get_float_array(&self, key: &str) -> Result<Vec<f64>> {
        let a = self.get_array(key)?;
        a.items
            .iter()
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.wrong(key, "array[float]", &Value::Array(a.clone())))
            })
            .collect()
    }

    /// An array of bools.
    pub fn get_bool_array(&self, key: &str) -> Result<Vec<bool>> {
        let a = self.get_array(key)?;
        a.items
            .iter()
            .map(|v| match v {
                Value::Bool(b) => Ok(*b),
                _ => Err(self.wrong(key, "array[bool]", &Value::Array(a.clone()))),
            })
            .collect()
    }

    fn wrong(&self, key: &str, expected: &str, found: &Value) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected: expected.to_string(),
            found: found.type_description(),
        }
    }
}
