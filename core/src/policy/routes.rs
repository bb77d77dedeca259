//! `routes`: limits per path prefix, all callers together.

use serde::Deserialize;

use crate::policy::{ConfigError, Limit, Policy};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    pub path_prefix: String,
    /// Requests on this route, all principals together.
    pub requests: Limit,
    /// Fair shares of the route's bucket; default: `defaults.shares`.
    pub shares: Option<crate::policy::shares::SharesConfig>,
}

/// Each route's prefix is a path and its name is used once.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    for (i, route) in p.routes.iter().enumerate() {
        if !route.path_prefix.starts_with('/') {
            return Err(ConfigError::at(
                format!("routes[{i}].path_prefix"),
                "must start with `/`",
            ));
        }
        if p.routes[..i].iter().any(|r| r.name == route.name) {
            return Err(ConfigError::at(
                format!("routes[{i}].name"),
                format!("route name `{}` is used twice", route.name),
            ));
        }
    }
    Ok(())
}
