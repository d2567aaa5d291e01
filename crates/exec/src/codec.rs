//! Plan fragments on the wire: datafusion-proto for DataFusion's operators, and this
//! extension codec for Tessera's (scans and both ends of exchanges), as JSON with any
//! physical expressions inside as protobuf.

use crate::exchange::{ExchangeReadExec, ExchangeWriteExec, ReadSpec, WriteSpec};
use crate::scan::{DistributedScanExec, ScanSpec};
use crate::split::{DemuxExec, SplitChannelExec};
use crate::Exec;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::from_proto::parse_physical_expr;
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use datafusion_proto::protobuf::PhysicalExprNode;
use prost::Message;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tessera_storage::versions::stored_schema;

#[derive(Debug, Serialize, Deserialize)]
enum Encoded {
    Scan {
        spec: ScanSpec,
        predicate: Option<Vec<u8>>,
    },
    Read {
        spec: ReadSpec,
        schema: arrow::datatypes::Schema,
    },
    Write {
        spec: WriteSpec,
        hash_exprs: Vec<Vec<u8>>,
    },
    /// A rebuilt channel split over several streams (its ordering follows from its input).
    Split { channel: usize, channels: usize },
    /// A storage exchange's bucket dealt to a split channel's streams.
    Demux {
        bucket: usize,
        keys: Vec<Vec<u8>>,
        group_of_partition: Vec<u32>,
        ways: usize,
    },
}

/// Encodes and decodes Tessera's operators; decoding binds them to `node`.
#[derive(Debug)]
pub struct TesseraCodec {
    pub node: Arc<Exec>,
}

impl TesseraCodec {
    fn encode_expr(
        &self,
        expr: &Arc<dyn PhysicalExpr>,
        converter: &dyn PhysicalProtoConverterExtension,
    ) -> DfResult<Vec<u8>> {
        Ok(converter
            .physical_expr_to_proto(expr, self)?
            .encode_to_vec())
    }

    fn decode_expr(
        &self,
        bytes: &[u8],
        ctx: &TaskContext,
        schema: &arrow::datatypes::Schema,
    ) -> DfResult<Arc<dyn PhysicalExpr>> {
        let node = PhysicalExprNode::decode(bytes)
            .map_err(|e| DataFusionError::Internal(format!("undecodable expression: {e}")))?;
        parse_physical_expr(&node, ctx, schema, self)
    }
}

impl PhysicalExtensionCodec for TesseraCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let encoded: Encoded = serde_json::from_slice(buf)
            .map_err(|e| DataFusionError::Internal(format!("undecodable Tessera operator: {e}")))?;
        Ok(match encoded {
            Encoded::Scan { spec, predicate } => {
                let predicate = predicate
                    .map(|bytes| self.decode_expr(&bytes, ctx, &stored_schema(&spec.def)))
                    .transpose()?;
                Arc::new(DistributedScanExec::try_new(
                    spec,
                    predicate,
                    self.node.clone(),
                )?)
            }
            Encoded::Read { spec, schema } => Arc::new(ExchangeReadExec::new(
                spec,
                Arc::new(schema),
                self.node.clone(),
            )),
            Encoded::Write { spec, hash_exprs } => {
                let input = inputs.first().cloned().ok_or_else(|| {
                    DataFusionError::Internal("an exchange writer arrived without its input".into())
                })?;
                let schema = input.schema();
                let hash_exprs = hash_exprs
                    .iter()
                    .map(|bytes| self.decode_expr(bytes, ctx, &schema))
                    .collect::<DfResult<_>>()?;
                Arc::new(ExchangeWriteExec::new(
                    spec,
                    hash_exprs,
                    input,
                    Some(self.node.clone()),
                ))
            }
            Encoded::Split { channel, channels } => {
                let input = inputs.first().cloned().ok_or_else(|| {
                    DataFusionError::Internal("a split channel arrived without its input".into())
                })?;
                Arc::new(SplitChannelExec::new(channel, channels, input))
            }
            Encoded::Demux {
                bucket,
                keys,
                group_of_partition,
                ways,
            } => {
                let input = inputs.first().cloned().ok_or_else(|| {
                    DataFusionError::Internal("a dealt bucket arrived without its reader".into())
                })?;
                let schema = input.schema();
                let keys = keys
                    .iter()
                    .map(|bytes| self.decode_expr(bytes, ctx, &schema))
                    .collect::<DfResult<_>>()?;
                Arc::new(DemuxExec::new(
                    input,
                    bucket,
                    keys,
                    group_of_partition,
                    ways,
                ))
            }
        })
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> DfResult<()> {
        let any: &dyn ExecutionPlan = node.as_ref();
        let encoded = if let Some(scan) = any.downcast_ref::<DistributedScanExec>() {
            Encoded::Scan {
                spec: scan.spec.clone(),
                predicate: scan
                    .predicate
                    .as_ref()
                    .map(|p| self.encode_expr(p, proto_converter))
                    .transpose()?,
            }
        } else if let Some(read) = any.downcast_ref::<ExchangeReadExec>() {
            Encoded::Read {
                spec: read.spec.clone(),
                schema: read.schema().as_ref().clone(),
            }
        } else if let Some(write) = any.downcast_ref::<ExchangeWriteExec>() {
            Encoded::Write {
                spec: write.spec.clone(),
                hash_exprs: write
                    .hash_exprs
                    .iter()
                    .map(|e| self.encode_expr(e, proto_converter))
                    .collect::<DfResult<_>>()?,
            }
        } else if let Some(split) = any.downcast_ref::<SplitChannelExec>() {
            Encoded::Split {
                channel: split.channel(),
                channels: split.properties().output_partitioning().partition_count(),
            }
        } else if let Some(demux) = any.downcast_ref::<DemuxExec>() {
            Encoded::Demux {
                bucket: demux.bucket(),
                keys: demux
                    .keys()
                    .iter()
                    .map(|e| self.encode_expr(e, proto_converter))
                    .collect::<DfResult<_>>()?,
                group_of_partition: demux.group_of_partition().to_vec(),
                ways: demux.properties().output_partitioning().partition_count(),
            }
        } else {
            return Err(DataFusionError::NotImplemented(format!(
                "{} cannot run on another node",
                node.name()
            )));
        };
        serde_json::to_writer(buf, &encoded)
            .map_err(|e| DataFusionError::Internal(format!("encoding {}: {e}", node.name())))
    }
}
