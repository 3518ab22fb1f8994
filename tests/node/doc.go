// Package node holds the end-to-end tests of the CSI Node service
// (pkg/driver's NewNodeService) on real loop devices, filesystems and mounts,
// with loopdisk standing in for KubeVirt's disk hotplug. It has no non-test
// code.
package node
