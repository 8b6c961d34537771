//! A small borrowed msgpack reader: exactly what vLLM's batches use (nil,
//! bool, ints, floats, str, bin, array, map; ext is skipped), with a precise
//! error (offset and reason) for anything malformed. Never panics.

/// Why a payload could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("msgpack at byte {offset}: {reason}")]
pub struct ReadError {
    /// Byte offset of the problem.
    pub offset: usize,
    /// What was wrong.
    pub reason: &'static str,
}

/// A msgpack value borrowing from the payload.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    /// nil
    Nil,
    /// true / false
    Bool(bool),
    /// Any unsigned int.
    UInt(u64),
    /// A negative int.
    Int(i64),
    /// float32 / float64
    Float(f64),
    /// str (UTF-8 checked)
    Str(&'a str),
    /// bin
    Bin(&'a [u8]),
    /// array
    Array(Vec<Value<'a>>),
    /// A non-empty array whose elements are all unsigned ints, decoded
    /// compactly (token ids and block hashes: the bulk of every batch).
    UInts(Vec<u64>),
    /// map, in wire order
    Map(Vec<(Value<'a>, Value<'a>)>),
    /// ext (type, data), kept opaque
    Ext(i8, &'a [u8]),
}

/// Limits nesting so hostile input cannot exhaust the stack.
const MAX_DEPTH: usize = 32;

/// A cursor over a payload.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Current offset.
    pub fn offset(&self) -> usize {
        self.pos
    }

    /// Whether every byte was read.
    pub fn at_end(&self) -> bool {
        self.pos >= self.buf.len()
    }

    fn err(&self, reason: &'static str) -> ReadError {
        ReadError { offset: self.pos, reason }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.err("length overflow"))?;
        let s = self.buf.get(self.pos..end).ok_or_else(|| self.err("truncated"))?;
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, ReadError> {
        self.take(1).map(|b| b.first().copied().unwrap_or(0))
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn len(&mut self, width: usize) -> Result<usize, ReadError> {
        Ok(match width {
            1 => usize::from(self.byte()?),
            2 => usize::from(u16::from_be_bytes(self.be()?)),
            _ => u32::from_be_bytes(self.be()?) as usize,
        })
    }

    fn str_of(&mut self, n: usize) -> Result<&'a str, ReadError> {
        let at = self.pos;
        let s = self.take(n)?;
        std::str::from_utf8(s).map_err(|_| ReadError { offset: at, reason: "string is not UTF-8" })
    }

    /// Reads the header of an array and returns its length.
    pub fn array_len(&mut self) -> Result<usize, ReadError> {
        let at = self.pos;
        let b = self.byte()?;
        match b {
            0x90..=0x9f => Ok(usize::from(b & 0x0f)),
            0xdc => self.len(2),
            0xdd => self.len(4),
            _ => Err(ReadError { offset: at, reason: "expected an array" }),
        }
    }

    /// Reads an unsigned int if the next value is one (else reads nothing).
    #[inline]
    fn uint_fast(&mut self) -> Result<Option<u64>, ReadError> {
        let Some(&b) = self.buf.get(self.pos) else { return Err(self.err("truncated")) };
        let v = match b {
            0x00..=0x7f => {
                self.pos += 1;
                u64::from(b)
            }
            0xcc..=0xcf => {
                self.pos += 1;
                match b {
                    0xcc => u64::from(self.byte()?),
                    0xcd => u64::from(u16::from_be_bytes(self.be()?)),
                    0xce => u64::from(u32::from_be_bytes(self.be()?)),
                    _ => u64::from_be_bytes(self.be()?),
                }
            }
            _ => return Ok(None),
        };
        Ok(Some(v))
    }

    /// Reads any value.
    pub fn value(&mut self) -> Result<Value<'a>, ReadError> {
        self.value_at(0)
    }

    fn value_at(&mut self, depth: usize) -> Result<Value<'a>, ReadError> {
        if depth > MAX_DEPTH {
            return Err(self.err("nested too deeply"));
        }
        let b = self.byte()?;
        Ok(match b {
            0x00..=0x7f => Value::UInt(u64::from(b)),
            0xe0..=0xff => Value::Int(i64::from(b as i8)),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xcc => Value::UInt(u64::from(self.byte()?)),
            0xcd => Value::UInt(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Value::UInt(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Value::UInt(u64::from_be_bytes(self.be()?)),
            0xd0 => Value::Int(i64::from(i8::from_be_bytes(self.be()?))),
            0xd1 => Value::Int(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => Value::Int(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => Value::Int(i64::from_be_bytes(self.be()?)),
            0xca => Value::Float(f64::from(f32::from_be_bytes(self.be()?))),
            0xcb => Value::Float(f64::from_be_bytes(self.be()?)),
            0xa0..=0xbf => Value::Str(self.str_of(usize::from(b & 0x1f))?),
            0xd9 => {
                let n = self.len(1)?;
                Value::Str(self.str_of(n)?)
            }
            0xda => {
                let n = self.len(2)?;
                Value::Str(self.str_of(n)?)
            }
            0xdb => {
                let n = self.len(4)?;
                Value::Str(self.str_of(n)?)
            }
            0xc4..=0xc6 => {
                let n = self.len(1 << (b - 0xc4))?;
                Value::Bin(self.take(n)?)
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                let n = match b {
                    0xdc => self.len(2)?,
                    0xdd => self.len(4)?,
                    _ => usize::from(b & 0x0f),
                };
                // Each element takes at least one byte: bound the allocation.
                let cap = n.min(self.buf.len().saturating_sub(self.pos));
                let mut uints = Vec::with_capacity(cap);
                while uints.len() < n {
                    match self.uint_fast()? {
                        Some(u) => uints.push(u),
                        None => break,
                    }
                }
                if n > 0 && uints.len() == n {
                    Value::UInts(uints)
                } else {
                    let mut v: Vec<Value<'a>> = Vec::with_capacity(cap);
                    v.extend(uints.into_iter().map(Value::UInt));
                    while v.len() < n {
                        v.push(self.value_at(depth + 1)?);
                    }
                    Value::Array(v)
                }
            }
            0x80..=0x8f | 0xde | 0xdf => {
                let n = match b {
                    0xde => self.len(2)?,
                    0xdf => self.len(4)?,
                    _ => usize::from(b & 0x0f),
                };
                let mut v = Vec::with_capacity(n.min(self.buf.len().saturating_sub(self.pos) / 2));
                for _ in 0..n {
                    let k = self.value_at(depth + 1)?;
                    let val = self.value_at(depth + 1)?;
                    v.push((k, val));
                }
                Value::Map(v)
            }
            0xd4..=0xd8 => {
                let n = 1usize << (b - 0xd4);
                let t = self.byte()? as i8;
                Value::Ext(t, self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.len(1 << (b - 0xc7))?;
                let t = self.byte()? as i8;
                Value::Ext(t, self.take(n)?)
            }
            _ => return Err(ReadError { offset: self.pos - 1, reason: "reserved msgpack byte 0xc1" }),
        })
    }
}
