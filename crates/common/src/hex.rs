//! Lower-case hexadecimal, for bytes that travel inside JSON (plan fragments, IPC rows).

/// `bytes` as lower-case hex, two digits a byte.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    out
}

/// The bytes `text` spells in hex; `None` if it is not an even run of hex digits.
pub fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// `batches` as an Arrow IPC stream in hex: rows that travel inside JSON.
pub fn batches_to_ipc_hex(
    schema: &arrow::datatypes::SchemaRef,
    batches: &[arrow::array::RecordBatch],
) -> Result<String, arrow::error::ArrowError> {
    let mut ipc = Vec::new();
    let mut writer = arrow::ipc::writer::StreamWriter::try_new(&mut ipc, schema)?;
    for batch in batches {
        writer.write(batch)?;
    }
    writer.finish()?;
    drop(writer);
    Ok(to_hex(&ipc))
}

/// The batches of an Arrow IPC stream in hex ([`batches_to_ipc_hex`]); `Err` says what is
/// wrong with it.
pub fn batches_from_ipc_hex(text: &str) -> Result<Vec<arrow::array::RecordBatch>, String> {
    let bytes = from_hex(text).ok_or("not hex")?;
    arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)
        .map_err(|e| e.to_string())?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_odd_or_foreign_text() {
        let bytes = vec![0u8, 1, 0x7f, 0x80, 0xff];
        assert_eq!(to_hex(&bytes), "00017f80ff");
        assert_eq!(from_hex(&to_hex(&bytes)), Some(bytes));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }
}
