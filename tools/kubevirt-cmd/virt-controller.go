// Command virt-controller is KubeVirt's virt-controller, unmodified, for tests.
package main

import "kubevirt.io/kubevirt/pkg/virt-controller/watch"

func main() { watch.Execute() }
