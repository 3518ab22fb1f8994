package integration

import (
	"context"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestClones clones volumes through the driver on the simulated Harvester,
// whose provisioner refuses what Longhorn and external-provisioner refuse:
// the host PVC is cloned from the source's host PVC with its class, volume
// mode and size, so the host accepts it, and a larger clone grows once bound.
func TestClones(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_8_2, Scale: scale})
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: kubevirt.BackendAuto, Queue: queueConfig(),
		Driver: driver.ControllerOptions{HostStorageClass: kubevirtsim.DefaultStorageClass}})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rwo := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	create := func(name string, bytes int64, params map[string]string, source string) (*csi.Volume, error) {
		t.Helper()
		req := &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwo},
			CapacityRange: &csi.CapacityRange{RequiredBytes: bytes}, Parameters: params}
		if source != "" {
			req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: source}}}
		}
		var vol *csi.Volume
		_, err := untilFinal(ctx, t, func(ctx context.Context) error {
			resp, err := ctrl.Client.CreateVolume(ctx, req)
			vol = resp.GetVolume()
			return err
		})
		return vol, err
	}
	// A filesystem host volume: its clones are too, whatever their class says.
	src, err := create("pvc-clone-src", 32<<20, map[string]string{"hostVolumeMode": "filesystem"}, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		bytes int64
	}{{"pvc-clone-same", 32 << 20}, {"pvc-clone-larger", 64 << 20}} {
		for attempt := range 2 { // the second is the provisioner's retry
			vol, err := create(tc.name, tc.bytes, nil, src.GetVolumeId())
			if err != nil {
				t.Fatalf("%s, attempt %d: %v", tc.name, attempt, err)
			}
			if vol.GetCapacityBytes() != tc.bytes || vol.GetContentSource().GetVolume().GetVolumeId() != src.GetVolumeId() {
				t.Errorf("%s, attempt %d: %+v, want %d bytes from %s", tc.name, attempt, vol, tc.bytes, src.GetVolumeId())
			}
		}
		pvc, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, tc.name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		req, capacity := pvc.Spec.Resources.Requests[corev1.ResourceStorage], pvc.Status.Capacity[corev1.ResourceStorage]
		if ds := pvc.Spec.DataSource; ds == nil || ds.Kind != "PersistentVolumeClaim" || ds.Name != src.GetVolumeId() ||
			ptr.Deref(pvc.Spec.VolumeMode, "") != corev1.PersistentVolumeFilesystem || ptr.Deref(pvc.Spec.StorageClassName, "") != kubevirtsim.DefaultStorageClass ||
			pvc.Status.Phase != corev1.ClaimBound || req.Value() != tc.bytes || capacity.Value() != tc.bytes || pvc.Labels[host.VolumeLabel] != host.VolumeLabelValue {
			t.Errorf("host PVC %s: data source %+v, mode %v, class %v, phase %s, request %s, capacity %s, labels %v",
				tc.name, pvc.Spec.DataSource, ptr.Deref(pvc.Spec.VolumeMode, ""), ptr.Deref(pvc.Spec.StorageClassName, ""), pvc.Status.Phase, req.String(), capacity.String(), pvc.Labels)
		}
	}

	for _, tc := range []struct {
		name, volume, source string
		want                 codes.Code
	}{
		{"missing source", "pvc-clone-orphan", "pvc-nowhere", codes.NotFound},
		{"the name of another volume's clone", "pvc-clone-same", "pvc-clone-larger", codes.AlreadyExists},
	} {
		if _, err := create(tc.volume, 32<<20, nil, tc.source); status.Code(err) != tc.want {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.want)
		}
	}
}
