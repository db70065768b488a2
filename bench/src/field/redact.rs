//! Redaction of names and addresses before a report leaves the machine.

use super::*;

/// Replaces every name that identifies the site with a placeholder.
#[derive(Default)]
pub(super) struct Redactor {
    /// (secret, placeholder), longest secret first.
    pub(super) pairs: Vec<(String, String)>,
    /// Also replace every iqn./eui./naa. name and IPv4 address left (in
    /// pasted output, error messages, resolved addresses).
    pub(super) scrub: bool,
}

impl Redactor {
    pub(super) fn for_run(a: &ReportArgs) -> Redactor {
        let mut pairs: Vec<(String, String)> = Vec::new();
        let mut add = |secret: &str, placeholder: String| {
            // Short names would hit other words; the scrub pass and the
            // field-level redaction cover names and addresses.
            if secret.len() >= 4 && !pairs.iter().any(|(s, _)| s == secret) {
                pairs.push((secret.to_string(), placeholder));
            }
        };
        for (i, u) in [&a.url, &a.compare].into_iter().flatten().enumerate() {
            if let Ok(url) = TargetUrl::parse(u) {
                add(&url.target_name, format!("iqn.redacted:target-{}", i + 1));
                add(&url.host, format!("box-{}", i + 1));
                if let Some((_, secret)) = &url.chap {
                    add(secret, "chap-secret".into());
                }
            }
        }
        add(&a.session.initiator_name, "iqn.redacted:initiator".into());
        for addr in [a.metrics, a.floor.floor].into_iter().flatten() {
            add(&addr.ip().to_string(), "box".into());
        }
        pairs.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
        Redactor { pairs, scrub: true }
    }

    pub(super) fn apply(&self, text: &str) -> String {
        let mut t = text.to_string();
        for (secret, placeholder) in &self.pairs {
            t = t.replace(secret.as_str(), placeholder);
        }
        if self.scrub {
            t = scrub(&t);
        }
        t
    }
}

pub(super) fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '_')
}

/// Replace SCSI names (`iqn.…`, `eui.…`, `naa.…`) and dotted-quad IPv4
/// addresses, token by token; the placeholders themselves are kept.
pub(super) fn scrub(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(name_char) {
        out.push_str(&rest[..start]);
        let tail = &rest[start..];
        let end = tail.find(|c| !name_char(c)).unwrap_or(tail.len());
        let token = &tail[..end];
        let lower = token.to_ascii_lowercase();
        let scsi_name = ["iqn.", "eui.", "naa."]
            .iter()
            .any(|p| lower.starts_with(p))
            && !lower.starts_with("iqn.redacted")
            && token.len() > 8;
        if scsi_name {
            out.push_str("iqn.redacted");
        } else {
            out.push_str(&scrub_ipv4(token));
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Within one token (e.g. `10.0.0.1:3260`), a dotted quad becomes `ip-redacted`.
pub(super) fn scrub_ipv4(token: &str) -> String {
    token
        .split(':')
        .map(|p| {
            let octets: Vec<&str> = p.split('.').collect();
            let quad = octets.len() == 4
                && octets.iter().all(|o| {
                    !o.is_empty() && o.len() <= 3 && o.bytes().all(|b| b.is_ascii_digit())
                });
            if quad {
                "ip-redacted"
            } else {
                p
            }
        })
        .collect::<Vec<_>>()
        .join(":")
}
