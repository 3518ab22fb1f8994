package kubevirt

import (
	"context"
	"testing"

	"k8s.io/client-go/rest"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

func TestDetectBackendWithoutAnAnswerIsUndecided(t *testing.T) {
	// Nothing listens on this port: neither the KubeVirt CR nor the setting
	// can be read, and that must not be mistaken for "no declarative hotplug".
	c, err := host.NewForConfig(&rest.Config{Host: "http://127.0.0.1:1"}, "guests")
	if err != nil {
		t.Fatal(err)
	}
	if name, why := DetectBackend(context.Background(), c); name != "" {
		t.Errorf("DetectBackend = %q (%s), want undecided", name, why)
	}
}
