//! The pods of a [`crate::Cluster`], shared whole ([`Pods`]): cloning a cluster, or the
//! controller handing its index's pods to a view, copies one pointer, not one per pod; a
//! change through [`std::ops::DerefMut`] copies the list first only while another holder
//! shares it (`Arc::make_mut`).

use std::sync::Arc;

use crate::Pod;

/// A cluster's pods, each shared, the list shared too.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pods(Arc<Vec<Arc<Pod>>>);

impl std::ops::Deref for Pods {
    type Target = Vec<Arc<Pod>>;
    fn deref(&self) -> &Vec<Arc<Pod>> {
        &self.0
    }
}

impl std::ops::DerefMut for Pods {
    fn deref_mut(&mut self) -> &mut Vec<Arc<Pod>> {
        Arc::make_mut(&mut self.0)
    }
}

impl From<Vec<Arc<Pod>>> for Pods {
    fn from(pods: Vec<Arc<Pod>>) -> Self {
        Pods(Arc::new(pods))
    }
}

impl FromIterator<Arc<Pod>> for Pods {
    fn from_iter<I: IntoIterator<Item = Arc<Pod>>>(iter: I) -> Self {
        Pods(Arc::new(iter.into_iter().collect()))
    }
}

impl<'a> IntoIterator for &'a Pods {
    type Item = &'a Arc<Pod>;
    type IntoIter = std::slice::Iter<'a, Arc<Pod>>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}
