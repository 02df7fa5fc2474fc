//! Collective data parallelism: every rank holds a whole replica of the
//! model, computes gradients on its slice of the global batch, and the
//! gradients are averaged by ring all-reduce of fused buckets, overlapped
//! with the rest of backward.

mod bucket;
mod checksum;
mod evaluation;
mod gradient_bucket;
mod gradient_sync;
pub mod preemption;
pub mod rank_figures;
mod rank_replica;
mod replica;
mod replica_optimizer;
mod sharded_checkpoint;
mod sharded_parameters;
mod sharded_states;
pub mod tensor_parallel;
pub mod training_state;

pub use bucket::{Bucket, BucketPlan};
pub use checksum::ParamChecksum;
pub use evaluation::score_pieces;
pub(crate) use evaluation::sum_over_ranks;
pub use gradient_sync::{Averaged, AveragedGradients, GradientSync, StepGradients};
pub use rank_replica::{Held, HeldOptimizer, RankReplica, Replicated, StateBytes, StepReport};
pub use replica::{backward_order, broadcast_parameters, Replica};
pub use replica_optimizer::ReplicaOptimizer;
pub use sharded_states::ShardedStates;
