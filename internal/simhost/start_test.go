package simhost

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
)

func TestHardUnplugNeedsDisks(t *testing.T) {
	_, err := Start(context.Background(), Options{HardUnplug: true})
	if err == nil || !strings.Contains(err.Error(), "HardUnplug needs Disks") {
		t.Fatalf("Start with HardUnplug and no Disks: %v, want the refusal", err)
	}
}

// The builder leaves a host whose guest VMs run and whose claims bind, set
// up as an installed Harvester when asked, and Stop leaves nothing of the
// temporary directory it made.
func TestStartAssemblesAHarvester(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	h, err := Start(ctx, Options{
		Sim: kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05},
		VMs: []string{"node-0", "node-1"}, Harvester: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	dir := h.tmp
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = h.Stop(context.Background())
		}
	})
	if h.Namespace != DefaultNamespace {
		t.Errorf("namespace %q, want %q", h.Namespace, DefaultNamespace)
	}
	for _, n := range []string{"node-0", "node-1"} {
		_, vmi := h.Sim.VM(h.Namespace, n)
		if vmi == nil || vmi.Status.Phase != kubevirtv1.Running {
			t.Errorf("VMI of guest node %s: %+v, want one running", n, vmi)
		}
	}
	vols, err := h.CreateVolumes(ctx, "pvc", 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range vols {
		pvc, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, v, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if pvc.Status.Phase != corev1.ClaimBound {
			t.Errorf("host PVC %s is %s, want Bound", v, pvc.Status.Phase)
		}
	}
	sc, err := h.Kube.StorageV1().StorageClasses().Get(ctx, h.StorageClass(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if sc.Annotations["storageclass.kubernetes.io/is-default-class"] != "true" {
		t.Errorf("class %s is not the default: %v", sc.Name, sc.Annotations)
	}
	dyn := dynamic.NewForConfigOrDie(h.Env.Config)
	settings := schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "settings"}
	if _, err := dyn.Resource(settings).Get(ctx, onlineExpandSetting, metav1.GetOptions{}); err != nil {
		t.Errorf("setting %s: %v", onlineExpandSetting, err)
	}

	stopped = true
	if err := h.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the host's temporary directory %s is still there (%v)", dir, err)
	}
}
