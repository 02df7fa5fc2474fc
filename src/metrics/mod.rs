//! Quality measures computed from a model's outputs.
//!
//! - `auc`: ROC AUC, the standard measure of click-through-rate models.

mod auc;

pub use auc::auc;
