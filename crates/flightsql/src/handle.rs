//! Prepared statement handles. Nothing is kept on the server for a prepared statement: its
//! handle carries its SQL and, once a client has bound parameters (`DoPut` on the
//! statement, answered with a new handle as Flight SQL's stateless services do), the bound
//! row as Arrow IPC. Any node serves any handle.

use arrow::array::RecordBatch;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use tonic::Status;

/// Starts a handle that carries bound parameters; a plain handle is the SQL text itself
/// (which never starts so).
const BOUND: &[u8] = b"tessera-bound-v1\n";

#[derive(Debug, PartialEq)]
pub(crate) enum Handle {
    /// A statement without bound parameters.
    Sql(String),
    /// A statement and the one row of values bound to its `$1..$n`.
    Bound { sql: String, params: RecordBatch },
}

impl Handle {
    pub(crate) fn sql(&self) -> &str {
        match self {
            Handle::Sql(sql) | Handle::Bound { sql, .. } => sql,
        }
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>, Status> {
        match self {
            Handle::Sql(sql) => Ok(sql.as_bytes().to_vec()),
            Handle::Bound { sql, params } => {
                let mut bytes = BOUND.to_vec();
                bytes.extend((sql.len() as u32).to_le_bytes());
                bytes.extend(sql.as_bytes());
                let encode = |e: arrow::error::ArrowError| {
                    Status::internal(format!("encoding the bound parameters: {e}"))
                };
                let mut writer =
                    StreamWriter::try_new(&mut bytes, &params.schema()).map_err(encode)?;
                writer.write(params).map_err(encode)?;
                writer.finish().map_err(encode)?;
                drop(writer);
                Ok(bytes)
            }
        }
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Handle, Status> {
        let bad = |what: &str| {
            Status::invalid_argument(format!(
                "the prepared statement handle is malformed: {what}"
            ))
        };
        let Some(rest) = bytes.strip_prefix(BOUND) else {
            return String::from_utf8(bytes.to_vec())
                .map(Handle::Sql)
                .map_err(|_| bad("not UTF-8 SQL text"));
        };
        let (length, rest) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| bad("no SQL length"))?;
        let length = u32::from_le_bytes(*length) as usize;
        if rest.len() < length {
            return Err(bad("shorter than its SQL"));
        }
        let (sql, ipc) = rest.split_at(length);
        let sql = String::from_utf8(sql.to_vec()).map_err(|_| bad("not UTF-8 SQL text"))?;
        let reader =
            StreamReader::try_new(ipc, None).map_err(|e| bad(&format!("parameters: {e}")))?;
        let batches = reader
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(&format!("parameters: {e}")))?;
        match <[RecordBatch; 1]>::try_from(batches) {
            Ok([params]) if params.num_rows() == 1 => Ok(Handle::Bound { sql, params }),
            _ => Err(bad("not one row of parameters")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    #[test]
    fn handles_round_trip_and_damaged_ones_are_named() {
        let plain = Handle::Sql("SELECT 1".into());
        assert_eq!(Handle::decode(&plain.encode().unwrap()).unwrap(), plain);
        let params = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("$1", DataType::Int64, true),
                Field::new("$2", DataType::Utf8, true),
            ])),
            vec![
                Arc::new(Int64Array::from(vec![7])),
                Arc::new(StringArray::from(vec!["x"])),
            ],
        )
        .unwrap();
        let bound = Handle::Bound {
            sql: "SELECT $1, $2".into(),
            params,
        };
        let bytes = bound.encode().unwrap();
        assert_eq!(Handle::decode(&bytes).unwrap(), bound);
        let cut = Handle::decode(&bytes[..bytes.len() - 9]).unwrap_err();
        assert!(cut.message().contains("handle is malformed"), "{cut}");
        assert_eq!(cut.code(), tonic::Code::InvalidArgument);
    }
}
