package main

import (
	"k8s.io/apimachinery/pkg/runtime"

	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/rbac"
)

// What the operator's generators are in KubeVirt v1.6 and v1.7 (the
// tools/kubevirt-v1.6.0 and -v1.7.0 modules link this file).

// controllerRBAC is virt-controller's RBAC; GetAllController takes the
// namespace alone before v1.8.
func controllerRBAC() []runtime.Object { return rbac.GetAllController(namespace) }

// lineCRDs are the CRDs of this line beyond those every line has: none.
func lineCRDs() []crdGenerator { return nil }
