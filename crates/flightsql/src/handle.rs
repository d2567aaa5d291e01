//! Statement handles and tickets. Nothing is kept on the server for a prepared statement
//! or a ticket: a handle carries its SQL and, once a client has bound parameters (`DoPut`
//! on the statement, answered with a new handle as Flight SQL's stateless services do),
//! the bound row as Arrow IPC; a statement inside a transaction also carries the
//! transaction's id (the one state a node keeps: see `transactions.rs`).

use arrow::array::RecordBatch;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use tonic::Status;

/// Starts a handle with parameters or a transaction; a plain handle is the SQL text itself
/// (which never starts so).
const FRAMED: &[u8] = b"tessera-handle-v2\n";

#[derive(Debug, PartialEq)]
pub(crate) struct Handle {
    pub sql: String,
    /// The one row of values bound to the statement's `$1..$n`.
    pub params: Option<RecordBatch>,
    /// The transaction the statement runs in.
    pub transaction: Option<Vec<u8>>,
}

impl Handle {
    pub(crate) fn new(sql: String, transaction: Option<Vec<u8>>) -> Handle {
        Handle {
            sql,
            params: None,
            transaction,
        }
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>, Status> {
        if self.params.is_none() && self.transaction.is_none() {
            return Ok(self.sql.as_bytes().to_vec());
        }
        let mut bytes = FRAMED.to_vec();
        for part in [
            self.sql.as_bytes(),
            self.transaction.as_deref().unwrap_or_default(),
        ] {
            bytes.extend((part.len() as u32).to_le_bytes());
            bytes.extend(part);
        }
        if let Some(params) = &self.params {
            let encode = |e: arrow::error::ArrowError| {
                Status::internal(format!("encoding the bound parameters: {e}"))
            };
            let mut writer = StreamWriter::try_new(&mut bytes, &params.schema()).map_err(encode)?;
            writer.write(params).map_err(encode)?;
            writer.finish().map_err(encode)?;
        }
        Ok(bytes)
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Handle, Status> {
        let bad = |what: &str| {
            Status::invalid_argument(format!("the statement handle is malformed: {what}"))
        };
        let utf8 =
            |bytes: &[u8]| String::from_utf8(bytes.to_vec()).map_err(|_| bad("not UTF-8 SQL text"));
        let Some(mut rest) = bytes.strip_prefix(FRAMED) else {
            return Ok(Handle::new(utf8(bytes)?, None));
        };
        let mut part = || -> Result<&[u8], Status> {
            let (length, after) = rest
                .split_first_chunk::<4>()
                .ok_or_else(|| bad("cut short"))?;
            let length = u32::from_le_bytes(*length) as usize;
            if after.len() < length {
                return Err(bad("cut short"));
            }
            let (part, after) = after.split_at(length);
            rest = after;
            Ok(part)
        };
        let sql = utf8(part()?)?;
        let transaction = Some(part()?.to_vec()).filter(|id| !id.is_empty());
        let params = if rest.is_empty() {
            None
        } else {
            let reader =
                StreamReader::try_new(rest, None).map_err(|e| bad(&format!("parameters: {e}")))?;
            let batches = reader
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(&format!("parameters: {e}")))?;
            match <[RecordBatch; 1]>::try_from(batches) {
                Ok([params]) if params.num_rows() == 1 => Some(params),
                _ => return Err(bad("not one row of parameters")),
            }
        };
        Ok(Handle {
            sql,
            params,
            transaction,
        })
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
        let plain = Handle::new("SELECT 1".into(), None);
        assert_eq!(
            plain.encode().unwrap(),
            b"SELECT 1",
            "a plain handle is its SQL"
        );
        assert_eq!(Handle::decode(&plain.encode().unwrap()).unwrap(), plain);
        let in_transaction = Handle::new("SELECT 2".into(), Some(vec![7; 16]));
        assert_eq!(
            Handle::decode(&in_transaction.encode().unwrap()).unwrap(),
            in_transaction
        );
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
        let bound = Handle {
            sql: "SELECT $1, $2".into(),
            params: Some(params),
            transaction: Some(vec![1, 2, 3]),
        };
        let bytes = bound.encode().unwrap();
        assert_eq!(Handle::decode(&bytes).unwrap(), bound);
        let cut = Handle::decode(&bytes[..bytes.len() - 9]).unwrap_err();
        assert!(cut.message().contains("handle is malformed"), "{cut}");
        assert_eq!(cut.code(), tonic::Code::InvalidArgument);
    }
}
