//! An answer on its way to the client. A query's rows are kept until the query finishes
//! while they fit the session's answer buffer (`tessera.answer_buffer`, 16 MiB by
//! default): such an answer is all or nothing, so a query that loses a node can still be
//! run again without the client seeing a row twice. A larger answer goes out as it comes
//! ([`StatementOutput::Streaming`]): the node holds at most the buffer and a few batches,
//! however large the answer, and an error after its first rows reaches the client as an
//! error mid-result, as PostgreSQL sends one.

use crate::engine::StatementOutput;
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::error::DataFusionError;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::SendableRecordBatchStream;
use futures::{stream, StreamExt, TryStreamExt};

/// The answer buffer when the session does not set one.
pub const DEFAULT_ANSWER_BUFFER_BYTES: u64 = 16 << 20;

/// Reads `answer` until it ends or holds more than `buffer` bytes (`None`: no limit). An
/// answer that ended is returned whole ([`StatementOutput::Rows`]); a larger one as the
/// rows read so far followed by the rest, still arriving. An error before the switch is
/// returned as it is, so the caller may still run the query again.
pub async fn buffered(
    mut answer: SendableRecordBatchStream,
    buffer: Option<u64>,
) -> Result<StatementOutput, DataFusionError> {
    let schema = answer.schema();
    let mut batches = Vec::new();
    let mut held: u64 = 0;
    while let Some(batch) = answer.next().await {
        let batch = batch?;
        held += batch.get_array_memory_size() as u64;
        batches.push(batch);
        if buffer.is_some_and(|limit| held > limit) {
            tracing::debug!(held, "the answer outgrew its buffer: it streams");
            let kept = stream::iter(batches.into_iter().map(Ok));
            return Ok(StatementOutput::Streaming {
                schema: schema.clone(),
                stream: Box::pin(RecordBatchStreamAdapter::new(schema, kept.chain(answer))),
            });
        }
    }
    Ok(StatementOutput::Rows { schema, batches })
}

/// Every row of `output`, read to its end: for callers that answer in one message.
pub async fn collected(output: StatementOutput) -> crate::error::Result<StatementOutput> {
    match output {
        StatementOutput::Streaming { schema, stream } => Ok(StatementOutput::Rows {
            schema,
            batches: stream
                .try_collect()
                .await
                .map_err(crate::error::from_datafusion)?,
        }),
        done => Ok(done),
    }
}

/// Reads the last of `outputs` whole, if it is still streaming.
pub async fn read_last_whole(outputs: &mut Vec<StatementOutput>) -> crate::error::Result<()> {
    if let Some(last) = outputs.pop() {
        outputs.push(collected(last).await?);
    }
    Ok(())
}

impl StatementOutput {
    /// An answer's columns and rows as a stream, whole or streaming; a command's tag and
    /// epoch otherwise.
    pub fn into_rows(
        self,
    ) -> Result<(SchemaRef, SendableRecordBatchStream), (String, Option<tessera_common::Epoch>)>
    {
        match self {
            StatementOutput::Rows { schema, batches } => {
                Ok((schema.clone(), stream_of(schema, batches)))
            }
            StatementOutput::Streaming { schema, stream } => Ok((schema, stream)),
            StatementOutput::Done { tag, epoch } => Err((tag, epoch)),
        }
    }
}

/// `answer` with `at_end` called once, when it ends: finished, failed (with its error), or
/// dropped before its end by a client that stopped reading.
pub fn on_end(
    answer: SendableRecordBatchStream,
    at_end: impl FnOnce(End) + Send + 'static,
) -> SendableRecordBatchStream {
    struct Watch<F: FnOnce(End)> {
        at_end: Option<F>,
    }
    impl<F: FnOnce(End)> Watch<F> {
        fn end(&mut self, how: End) {
            if let Some(at_end) = self.at_end.take() {
                at_end(how);
            }
        }
    }
    impl<F: FnOnce(End)> Drop for Watch<F> {
        fn drop(&mut self) {
            self.end(End::Dropped);
        }
    }
    let schema: SchemaRef = answer.schema();
    let watch = Watch {
        at_end: Some(at_end),
    };
    let watched = stream::unfold(
        (answer, watch, false),
        |(mut answer, mut watch, over)| async move {
            if over {
                return None;
            }
            match answer.next().await {
                Some(Ok(batch)) => Some((Ok(batch), (answer, watch, false))),
                Some(Err(error)) => {
                    watch.end(End::Failed(error.to_string()));
                    Some((Err(error), (answer, watch, true)))
                }
                None => {
                    watch.end(End::Finished);
                    None
                }
            }
        },
    );
    Box::pin(RecordBatchStreamAdapter::new(schema, watched))
}

/// How a streamed answer ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    Finished,
    Failed(String),
    /// The client stopped reading (it went away, or cancelled).
    Dropped,
}

/// `batches` as a stream of `schema`.
pub fn stream_of(schema: SchemaRef, batches: Vec<RecordBatch>) -> SendableRecordBatchStream {
    Box::pin(RecordBatchStreamAdapter::new(
        schema,
        stream::iter(batches.into_iter().map(Ok)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::{Arc, Mutex};

    fn batches(count: usize, rows: i64) -> (SchemaRef, Vec<RecordBatch>) {
        let schema = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, false)]));
        let batches = (0..count)
            .map(|i| {
                let values = Int64Array::from_iter_values((0..rows).map(|r| i as i64 * rows + r));
                RecordBatch::try_new(schema.clone(), vec![Arc::new(values)]).unwrap()
            })
            .collect();
        (schema, batches)
    }

    #[tokio::test]
    async fn an_answer_within_the_buffer_is_kept_whole_and_a_larger_one_streams_in_order() {
        let (schema, small) = batches(3, 100);
        let output = buffered(stream_of(schema.clone(), small.clone()), Some(1 << 20))
            .await
            .unwrap();
        let StatementOutput::Rows { batches: kept, .. } = output else {
            panic!("an answer under the buffer streamed");
        };
        assert_eq!(kept, small);

        let (schema, large) = batches(20, 10_000);
        let one_batch = large[0].get_array_memory_size() as u64;
        let output = buffered(
            stream_of(schema.clone(), large.clone()),
            Some(one_batch * 2),
        )
        .await
        .unwrap();
        assert!(matches!(output, StatementOutput::Streaming { .. }));
        let StatementOutput::Rows { batches: all, .. } = collected(output).await.unwrap() else {
            panic!("collected answers are rows");
        };
        assert_eq!(all, large, "every row once, in order");

        let output = buffered(stream_of(schema, large.clone()), None)
            .await
            .unwrap();
        assert!(
            matches!(output, StatementOutput::Rows { .. }),
            "no buffer limit keeps it all"
        );
    }

    #[tokio::test]
    async fn an_error_before_the_switch_is_returned_and_after_it_is_streamed() {
        let (schema, good) = batches(4, 10_000);
        let one_batch = good[0].get_array_memory_size() as u64;
        let failing = |after: usize| {
            let items: Vec<Result<RecordBatch, DataFusionError>> = good[..after]
                .iter()
                .cloned()
                .map(Ok)
                .chain([Err(DataFusionError::Execution("node 2 died".into()))])
                .collect();
            Box::pin(RecordBatchStreamAdapter::new(
                schema.clone(),
                stream::iter(items),
            )) as SendableRecordBatchStream
        };
        let early = buffered(failing(1), Some(one_batch * 3)).await;
        assert!(early.unwrap_err().to_string().contains("node 2 died"));

        let late = buffered(failing(4), Some(one_batch)).await.unwrap();
        let StatementOutput::Streaming { stream, .. } = late else {
            panic!("the answer outgrew its buffer");
        };
        let items: Vec<_> = stream.collect().await;
        assert_eq!(items.iter().filter(|i| i.is_ok()).count(), 4);
        assert!(items.last().unwrap().is_err(), "the error ends the stream");
    }

    #[tokio::test]
    async fn the_end_is_seen_once_however_the_answer_ends() {
        let (schema, good) = batches(3, 10);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let watch = |seen: &Arc<Mutex<Vec<End>>>| {
            let seen = seen.clone();
            move |end| seen.lock().unwrap().push(end)
        };
        let finished = on_end(stream_of(schema.clone(), good.clone()), watch(&seen));
        assert_eq!(finished.collect::<Vec<_>>().await.len(), 3);
        let mut dropped = on_end(stream_of(schema.clone(), good), watch(&seen));
        dropped.next().await.unwrap().unwrap();
        drop(dropped);
        let failing = Box::pin(RecordBatchStreamAdapter::new(
            schema,
            stream::iter([Err(DataFusionError::Execution("boom".into()))]),
        ));
        let failed = on_end(failing, watch(&seen));
        assert_eq!(failed.collect::<Vec<_>>().await.len(), 1);
        assert_eq!(
            *seen.lock().unwrap(),
            [
                End::Finished,
                End::Dropped,
                End::Failed("Execution error: boom".into())
            ]
        );
    }
}
