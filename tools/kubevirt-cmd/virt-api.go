// Command virt-api is KubeVirt's virt-api, unmodified, for tests.
package main

import (
	klog "kubevirt.io/client-go/log"

	"kubevirt.io/kubevirt/pkg/service"
	virtapi "kubevirt.io/kubevirt/pkg/virt-api"
)

func main() {
	klog.InitializeLogging("virt-api")
	app := virtapi.NewVirtApi()
	service.Setup(app)
	app.Execute()
}
