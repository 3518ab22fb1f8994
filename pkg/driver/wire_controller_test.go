package driver

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/rest"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
)

// The queue exists from NewController on, before the host has said which
// hotplug path it expects: the publish path holds it directly, and while the
// backend is still detecting, the controller is not ready and the queue
// answers ErrNotReady without writing anything.
func TestControllerHoldsItsQueueBeforeTheHostAnswers(t *testing.T) {
	// Nothing listens on this port: detection cannot decide.
	hc, err := host.NewForConfig(&rest.Config{Host: "http://127.0.0.1:1"}, "guests")
	if err != nil {
		t.Fatal(err)
	}
	ctrl := NewController(ControllerConfig{Host: hc, Backend: kubevirt.BackendAuto})
	q := ctrl.Queue()
	if q == nil {
		t.Fatal("NewController built no queue")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ctrl.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	testwait.Until(wctx, t, "the controller to say it is detecting the hotplug backend", func() (bool, string) {
		err := ctrl.Ready()
		if err == nil {
			return false, "ready"
		}
		return strings.Contains(err.Error(), "detecting the hotplug backend: "), err.Error()
	})
	if err := q.Attach(ctx, "vm-1", "pvc-a", true); !errors.Is(err, hotplug.ErrNotReady) {
		t.Errorf("attach while the backend is undecided answered %v, want ErrNotReady", err)
	}
	if name := q.BackendName(); name != "" {
		t.Errorf("backend named %q before detection", name)
	}
}

// A backend that cannot exist is refused when the controller is built, and
// every call is answered "not ready" with the reason.
func TestControllerWithAnUnknownBackendSaysWhy(t *testing.T) {
	hc, err := host.NewForConfig(&rest.Config{Host: "http://127.0.0.1:1"}, "guests")
	if err != nil {
		t.Fatal(err)
	}
	ctrl := NewController(ControllerConfig{Host: hc, Backend: "sideways"})
	if err := ctrl.Ready(); err == nil || !strings.Contains(err.Error(), `unknown hotplug backend "sideways"`) {
		t.Errorf("Ready() = %v, want it to name the unknown backend", err)
	}
	if err := ctrl.Run(context.Background()); err == nil {
		t.Error("Run with an unknown backend returned nil")
	}
}
