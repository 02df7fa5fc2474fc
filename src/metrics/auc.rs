//! Exact ROC AUC: the chance that a random positive scores above a random
//! negative, ties counting one half — how CTR models are compared, since it
//! ignores calibration and class imbalance.

/// The ROC AUC of `scores` against `labels` (a label above 0.5 is positive),
/// computed exactly as the Mann–Whitney U statistic: sort by score, give tied
/// scores their average rank, `AUC = (Σ positive ranks − P(P+1)/2) / (P·N)`.
///
/// `None` when it is undefined: lengths differ, or only one class is present.
/// Scores are ordered by `f32::total_cmp`, so NaN scores rank above every
/// number rather than poisoning the sort. O(n log n) time, O(n) memory.
pub fn auc(scores: &[f32], labels: &[f32]) -> Option<f64> {
    if scores.len() != labels.len() {
        return None;
    }
    let positives = labels.iter().filter(|&&l| l > 0.5).count();
    let negatives = labels.len() - positives;
    if positives == 0 || negatives == 0 {
        return None;
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_unstable_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let mut positive_rank_sum = 0.0;
    let mut start = 0;
    while start < order.len() {
        // The run of tied scores order[start..end] shares ranks start+1..=end.
        let score = scores[order[start]];
        let end = start
            + order[start..]
                .iter()
                .take_while(|&&i| scores[i].total_cmp(&score).is_eq())
                .count();
        let average_rank = (start + 1 + end) as f64 / 2.0;
        let tied_positives = order[start..end].iter().filter(|&&i| labels[i] > 0.5).count();
        positive_rank_sum += average_rank * tied_positives as f64;
        start = end;
    }
    let (p, n) = (positives as f64, negatives as f64);
    Some((positive_rank_sum - p * (p + 1.0) / 2.0) / (p * n))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AUC by comparing every positive with every negative: slow but obvious.
    fn pairwise(scores: &[f32], labels: &[f32]) -> f64 {
        let (mut wins, mut pairs) = (0.0, 0.0);
        for (i, &li) in labels.iter().enumerate() {
            for (j, &lj) in labels.iter().enumerate() {
                if li > 0.5 && lj <= 0.5 {
                    pairs += 1.0;
                    wins += match scores[i].partial_cmp(&scores[j]) {
                        Some(std::cmp::Ordering::Greater) => 1.0,
                        Some(std::cmp::Ordering::Equal) => 0.5,
                        _ => 0.0,
                    };
                }
            }
        }
        wins / pairs
    }

    #[test]
    fn perfect_and_inverted_rankings() {
        let labels = [0.0, 0.0, 1.0, 1.0, 1.0];
        assert_eq!(auc(&[0.1, 0.2, 0.3, 0.4, 0.5], &labels), Some(1.0));
        assert_eq!(auc(&[0.5, 0.4, 0.3, 0.2, 0.1], &labels), Some(0.0));
    }

    #[test]
    fn all_ties_give_one_half() {
        assert_eq!(auc(&[0.7; 6], &[1.0, 0.0, 1.0, 0.0, 0.0, 1.0]), Some(0.5));
    }

    #[test]
    fn hand_computed_case_with_ties() {
        // Positives score 0.8, 0.4, 0.4; negatives 0.4, 0.2.
        // Pairs won: 0.8 beats both (2); each 0.4 ties 0.4 (½) and beats 0.2 (1).
        // AUC = (2 + 1.5 + 1.5) / 6 = 5/6.
        let scores = [0.8, 0.4, 0.4, 0.4, 0.2];
        let labels = [1.0, 1.0, 1.0, 0.0, 0.0];
        let a = auc(&scores, &labels).unwrap_or(f64::NAN);
        assert!((a - 5.0 / 6.0).abs() < 1e-12, "{a}");
    }

    #[test]
    fn agrees_with_pairwise_counting_on_random_data() {
        let mut rng = crate::rng::SplitMix64::new(3);
        let scores: Vec<f32> = (0..300).map(|_| (rng.below(20) as f32) / 4.0).collect();
        let labels: Vec<f32> = scores
            .iter()
            .map(|&s| if rng.next_f32() * 5.0 < s { 1.0 } else { 0.0 })
            .collect();
        let a = auc(&scores, &labels).unwrap_or(f64::NAN);
        assert!((a - pairwise(&scores, &labels)).abs() < 1e-12);
    }

    #[test]
    fn undefined_cases_are_none() {
        assert_eq!(auc(&[0.1, 0.2], &[1.0, 1.0]), None);
        assert_eq!(auc(&[0.1, 0.2], &[0.0, 0.0]), None);
        assert_eq!(auc(&[0.1], &[0.0, 1.0]), None);
        assert_eq!(auc(&[], &[]), None);
    }
}
