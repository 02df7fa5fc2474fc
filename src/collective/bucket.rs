//! Gradient buckets: parameters in the order backward produces their
//! gradients (last block first), grouped into buckets of about
//! `fuse_grad_size_in_MB`, so each bucket's all-reduce can start as soon as
//! its last gradient exists and many small tensors travel as one message.

/// A group of parameters all-reduced as one flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Indices into the model's parameter list, in fill order.
    pub params: Vec<usize>,
    /// Total number of values.
    pub len: usize,
}

/// The buckets of one model, identical on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// Buckets in fill (and all-reduce) order.
    pub buckets: Vec<Bucket>,
}

impl BucketPlan {
    /// Groups parameters, given as `(index, values)` in backward order, into
    /// buckets that close once they reach `cap_bytes` (a parameter larger
    /// than the cap gets a bucket of its own).
    pub fn new(backward_order: &[(usize, usize)], cap_bytes: usize) -> Self {
        let cap_values = (cap_bytes / std::mem::size_of::<f32>()).max(1);
        let mut buckets = Vec::new();
        let mut current = Bucket {
            params: Vec::new(),
            len: 0,
        };
        for &(index, values) in backward_order {
            current.params.push(index);
            current.len += values;
            if current.len >= cap_values {
                buckets.push(std::mem::replace(
                    &mut current,
                    Bucket {
                        params: Vec::new(),
                        len: 0,
                    },
                ));
            }
        }
        if !current.params.is_empty() {
            buckets.push(current);
        }
        Self { buckets }
    }

    /// One bucket per block (sharded parameters gather a block's at once): parameters given as
    /// `(index, values, block)` in backward order, a bucket closing where the block changes.
    pub fn per_block(backward_order: &[(usize, usize, usize)]) -> Self {
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut previous = None;
        for &(index, values, block) in backward_order {
            match buckets.last_mut() {
                Some(bucket) if previous == Some(block) => {
                    bucket.params.push(index);
                    bucket.len += values;
                }
                _ => buckets.push(Bucket {
                    params: vec![index],
                    len: values,
                }),
            }
            previous = Some(block);
        }
        Self { buckets }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_close_at_the_cap_and_keep_order() {
        let plan = BucketPlan::new(&[(3, 10), (2, 5), (1, 40), (0, 3)], 15 * 4);
        assert_eq!(
            plan.buckets.iter().map(|b| b.params.clone()).collect::<Vec<_>>(),
            vec![vec![3, 2], vec![1], vec![0]]
        );
        assert_eq!(plan.buckets.iter().map(|b| b.len).sum::<usize>(), 58);
        let one = BucketPlan::new(&[(1, 10), (0, 3)], 1 << 30);
        assert_eq!(one.buckets.len(), 1);
    }

    #[test]
    fn per_block_buckets_close_where_the_block_changes() {
        let plan = BucketPlan::per_block(&[(3, 10, 2), (2, 5, 2), (1, 40, 1), (0, 3, 0)]);
        let cut: Vec<(Vec<usize>, usize)> = plan.buckets.into_iter().map(|b| (b.params, b.len)).collect();
        assert_eq!(cut, vec![(vec![3, 2], 15), (vec![1], 40), (vec![0], 3)]);
    }
}
