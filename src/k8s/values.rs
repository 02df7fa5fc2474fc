//! The values of `flotilla k8s`'s flags in the grammars the API server checks them by: object
//! names (RFC 1123 labels and subdomains), quantities, label keys and values, and tolerations
//! in the taint syntax of `kubectl taint`. A value the API server would reject is refused here,
//! naming its flag, rather than rendered into manifests `kubectl apply` fails on.

use anyhow::{bail, ensure, Result};
use k8s_openapi::api::core::v1::Toleration;

/// Longest RFC 1123 label: a namespace's or a Service's name, a label value, a label key's name.
const LABEL_MAX: usize = 63;
/// Longest RFC 1123 subdomain: most objects' names, a label key's prefix.
const SUBDOMAIN_MAX: usize = 253;
/// The suffixes of a quantity besides an exponent: binary, then decimal SI.
const QUANTITY_SUFFIXES: [&str; 15] = [
    "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E",
];
/// What a taint (and so a toleration) may do to a pod.
const TAINT_EFFECTS: [&str; 3] = ["NoSchedule", "PreferNoSchedule", "NoExecute"];

/// Lowercase letters, digits and '-', starting and ending with a letter or digit.
fn label_shaped(text: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    text.starts_with(alnum) && text.ends_with(alnum) && text.chars().all(|c| alnum(c) || c == '-')
}

/// Refuses `value` of `flag` unless it is an RFC 1123 label (a namespace's name).
pub(super) fn dns_label(flag: &str, value: &str) -> Result<()> {
    ensure!(
        value.len() <= LABEL_MAX && label_shaped(value),
        "{flag} {value:?}: not a DNS label (RFC 1123: at most {LABEL_MAX} lowercase letters, digits and '-', starting and ending with a letter or digit)"
    );
    Ok(())
}

/// Refuses `value` of `flag` unless it is an RFC 1123 subdomain (the name of a Secret, a
/// StorageClass, a PriorityClass).
pub(super) fn dns_subdomain(flag: &str, value: &str) -> Result<()> {
    ensure!(
        value.len() <= SUBDOMAIN_MAX && value.split('.').all(label_shaped),
        "{flag} {value:?}: not a DNS subdomain (RFC 1123: at most {SUBDOMAIN_MAX} characters, labels of lowercase letters, digits and '-' joined by '.')"
    );
    Ok(())
}

/// Refuses an empty image reference, or one with white space (the API server refuses both).
pub(super) fn image(value: &str) -> Result<()> {
    ensure!(
        !value.is_empty() && !value.contains(char::is_whitespace),
        "--image {value:?}: not an image reference (REGISTRY/NAME:TAG, neither empty nor holding white space)"
    );
    Ok(())
}

/// Refuses `value` of `flag` unless it is a positive quantity: a decimal number, then one of
/// the suffixes `Ki Mi Gi Ti Pi Ei n u m k M G T P E` or an exponent `e`/`E` and an integer.
pub(super) fn positive_quantity(flag: &str, value: &str) -> Result<()> {
    let unsigned = value.strip_prefix(['+', '-']).unwrap_or(value);
    let number_end = unsigned
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(unsigned.len());
    let (number, suffix) = unsigned.split_at(number_end);
    let exponent = suffix
        .strip_prefix(['e', 'E'])
        .map(|power| power.strip_prefix(['+', '-']).unwrap_or(power))
        .is_some_and(|digits| !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()));
    let valid = number.chars().any(|c| c.is_ascii_digit())
        && number.matches('.').count() <= 1
        && (suffix.is_empty() || QUANTITY_SUFFIXES.contains(&suffix) || exponent);
    ensure!(
        valid,
        "{flag} {value:?}: not a Kubernetes quantity (a decimal number, then Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E or an exponent such as e3; e.g. 10Gi)"
    );
    let positive = !value.starts_with('-') && number.chars().any(|c| c.is_ascii_digit() && c != '0');
    ensure!(positive, "{flag} {value:?}: a size is more than zero");
    Ok(())
}

/// Whether `name` is the name part of a label key: at most 63 letters, digits, '-', '_' and
/// '.', starting and ending with a letter or digit. A label value is one, or empty.
fn label_name(name: &str) -> bool {
    name.len() <= LABEL_MAX
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Refuses `key` of `flag` unless it is a label (or taint) key: a name, after an optional
/// subdomain prefix and '/'.
fn label_key(flag: &str, text: &str, key: &str) -> Result<()> {
    let (prefix, name) = key.rsplit_once('/').map_or((None, key), |(p, n)| (Some(p), n));
    let prefix_valid = prefix.is_none_or(|p| p.len() <= SUBDOMAIN_MAX && p.split('.').all(label_shaped));
    ensure!(
        prefix_valid && label_name(name),
        "{flag} {text:?}: {key:?} is not a label key ([PREFIX/]NAME: a NAME of at most {LABEL_MAX} letters, digits, '-', '_' and '.', starting and ending with a letter or digit; a PREFIX a DNS subdomain)"
    );
    Ok(())
}

/// Refuses `value` of `flag` unless it is a label (or taint) value: empty, or a label name.
fn label_value(flag: &str, text: &str, value: &str) -> Result<()> {
    ensure!(
        value.is_empty() || label_name(value),
        "{flag} {text:?}: {value:?} is not a label value (at most {LABEL_MAX} letters, digits, '-', '_' and '.', starting and ending with a letter or digit)"
    );
    Ok(())
}

/// `--node-selector KEY=VALUE`: a node label the pods are scheduled on nodes with.
pub(super) fn node_selector(text: &str) -> Result<(String, String)> {
    let flag = "--node-selector";
    let Some((key, value)) = text.split_once('=') else {
        bail!("{flag} {text:?}: not KEY=VALUE (a node label, e.g. cloud.google.com/gke-nodepool=gpu)");
    };
    label_key(flag, text, key)?;
    label_value(flag, text, value)?;
    Ok((key.to_string(), value.to_string()))
}

/// `--toleration KEY[=VALUE]:EFFECT`, a taint as `kubectl taint` writes it: the pods tolerate
/// it (`Equal` with a value, `Exists` without).
pub(super) fn toleration(text: &str) -> Result<Toleration> {
    let flag = "--toleration";
    let Some((taint, effect)) = text.rsplit_once(':') else {
        bail!("{flag} {text:?}: not KEY[=VALUE]:EFFECT (a taint as kubectl taint writes it, e.g. nvidia.com/gpu=present:NoSchedule)");
    };
    ensure!(
        TAINT_EFFECTS.contains(&effect),
        "{flag} {text:?}: the effect {effect:?} is none of {}",
        TAINT_EFFECTS.join(", ")
    );
    let (key, value) = taint.split_once('=').map_or((taint, None), |(k, v)| (k, Some(v)));
    label_key(flag, text, key)?;
    if let Some(value) = value {
        label_value(flag, text, value)?;
    }
    Ok(Toleration {
        key: Some(key.to_string()),
        operator: Some(if value.is_some() { "Equal" } else { "Exists" }.to_string()),
        value: value.map(str::to_string),
        effect: Some(effect.to_string()),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_follow_the_api_servers_grammar() {
        for good in [
            "10Gi", "1", "0.5Ti", ".5G", "1.", "+3M", "1e3", "2E-2", "100k", "7E", "5m",
        ] {
            assert!(positive_quantity("--storage", good).is_ok(), "{good}");
        }
        for bad in [
            "10XB", "", "Gi", "1.2.3", "10 Gi", "1e", "1e+", "10gi", "1KiB", "0", "-1Gi", "0.0Mi",
        ] {
            assert!(positive_quantity("--storage", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_are_rfc_1123_labels_and_subdomains() {
        assert!(dns_label("--namespace", "team-a1").is_ok());
        for bad in ["Bad_NS", "", "-a", "a-", "a.b", &"a".repeat(64)] {
            assert!(dns_label("--namespace", bad).is_err(), "{bad}");
        }
        assert!(dns_subdomain("--priority-class", "high.example-1").is_ok());
        for bad in ["High", "a..b", ".a", "a_b"] {
            assert!(dns_subdomain("--priority-class", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tolerations_read_the_taint_syntax() -> Result<()> {
        let equal = toleration("nvidia.com/gpu=present:NoSchedule")?;
        assert_eq!(
            (equal.key.as_deref(), equal.operator.as_deref(), equal.value.as_deref()),
            (Some("nvidia.com/gpu"), Some("Equal"), Some("present"))
        );
        assert_eq!(equal.effect.as_deref(), Some("NoSchedule"));
        let exists = toleration("spot:NoExecute")?;
        assert_eq!((exists.operator.as_deref(), exists.value), (Some("Exists"), None));
        for bad in [
            "gpu",
            "gpu=a:Never",
            ":NoSchedule",
            "a b=c:NoSchedule",
            "k=v v:NoSchedule",
        ] {
            assert!(toleration(bad).is_err(), "{bad}");
        }
        Ok(())
    }

    #[test]
    fn node_selectors_are_label_pairs() -> Result<()> {
        assert_eq!(node_selector("pool=gpu")?, ("pool".to_string(), "gpu".to_string()));
        assert_eq!(node_selector("example.com/empty=")?.1, "");
        for bad in ["pool", "=gpu", "-pool=gpu", "pool=gp u", "a/b/c=d"] {
            assert!(node_selector(bad).is_err(), "{bad}");
        }
        Ok(())
    }
}
