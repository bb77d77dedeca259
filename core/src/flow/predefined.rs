//! What flow defines when a policy loads: every stat of the table
//! (`crate::host::metrics`) that has no labels, and the label values an
//! alert reads before anything happens (each identity refusal's
//! `sluice_auth_failures_total`, both kinds of upstream pause), so each
//! exists at 0 and its first change is visible.

use crate::admission::identity::AuthRefusal;
use crate::host::metrics::{self, AUTH_FAILURES, UPSTREAM_PAUSES};
use crate::host::Host;

/// Every identity refusal (the auth-failure alert reads each).
pub const AUTH_REFUSALS: [AuthRefusal; 4] = [
    AuthRefusal::UnknownKey,
    AuthRefusal::UnverifiedJwt,
    AuthRefusal::ConflictingCredentials,
    AuthRefusal::EmptyCredential,
];

pub fn define(host: &dyn Host) {
    metrics::define_fixed(host);
    for why in AUTH_REFUSALS {
        AUTH_FAILURES.define_at(host, &[why.code()]);
    }
    for kind in ["route", "credential"] {
        UPSTREAM_PAUSES.define_at(host, &[kind]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new `AuthRefusal` must be added to [`AUTH_REFUSALS`]: this match has
    /// no wildcard, so it stops compiling until it is.
    #[test]
    fn every_auth_failure_reason_is_defined_at_load() {
        for why in AUTH_REFUSALS {
            match why {
                AuthRefusal::UnknownKey
                | AuthRefusal::UnverifiedJwt
                | AuthRefusal::ConflictingCredentials
                | AuthRefusal::EmptyCredential => {}
            }
        }
        let host = crate::host::mock::MockHost::new(0);
        define(&host);
        for why in AUTH_REFUSALS {
            assert_eq!(host.metric(&AUTH_FAILURES.named(&[why.code()])), Some(0));
        }
        assert_eq!(host.metric(metrics::FLEET_DATA_LOST.name), Some(0));
    }
}
