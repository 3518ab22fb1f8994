package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// rwxSuite is a host whose simulator plays networkfs-manager, a guest API
// server holding the pods that use RWX claims, and the controller with both.
type rwxSuite struct {
	host  *framework.Host
	guest *framework.Guest
	ctrl  *framework.Controller
	hc    *host.Client // admin, for live reads of what the driver wrote
}

func rwxCap(mode csi.VolumeCapability_AccessMode_Mode, block bool, flags ...string) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if block {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4", MountFlags: flags}}
	}
	return c
}

var rwxMount = rwxCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, false)

// TestRWX runs ReadWriteMany volumes against the simulator's
// networkfs-manager on a real API server: create, publish to two VMs,
// unpublish while a guest pod still uses the claim, unpublish of the last
// user, delete, idempotency and bad input.
func TestRWX(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Scale: scale})
	s := &rwxSuite{host: h, guest: framework.StartGuest(t)}
	s.ctrl = h.StartController(t, framework.ControllerOptions{Backend: kubevirt.BackendSubresource, Queue: queueConfig(),
		Guest: s.guest.Env.Config, Driver: driver.ControllerOptions{HostStorageClass: kubevirtsim.DefaultStorageClass}})
	if !s.ctrl.Driver.RWXEnabled() {
		t.Fatal("the host lists NetworkFilesystems, but the controller does not serve RWX volumes")
	}
	var err error
	if s.hc, err = host.NewForConfig(h.Env.Config, h.Namespace); err != nil {
		t.Fatal(err)
	}
	h.CreateVMs(t, "vm-a", "vm-b")
	t.Run("CreatePublishUnpublishDelete", s.lifecycle)
	t.Run("BadInput", s.badInput)
	t.Run("NameOfTheOtherKind", s.nameOfTheOtherKind)
	t.Run("AttachmentsOfOtherNodesKeepTheExport", s.attachmentsKeepTheExport)
	t.Run("PublishedNodesAreTheAttachedOnes", s.publishedNodes)
}

// nameOfTheOtherKind: a name taken by a single-node filesystem volume is
// not made ReadWriteMany, nor the other way round, also for a shared volume
// the upstream driver made (no annotation of this driver: judged by its
// NetworkFilesystem).
func (s *rwxSuite) nameOfTheOtherKind(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	single := func(name string) error {
		_, err := s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name,
			VolumeCapabilities: []*csi.VolumeCapability{rwxCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, false)},
			CapacityRange:      &csi.CapacityRange{RequiredBytes: 1 << 30},
			Parameters:         map[string]string{"hostStorageClass": kubevirtsim.DefaultStorageClass, "hostVolumeMode": "filesystem"}})
		return err
	}
	expect := func(what string, err error, name string) {
		t.Helper()
		if status.Code(err) != codes.AlreadyExists || !strings.Contains(status.Convert(err).Message(), name) {
			t.Errorf("%s: %v, want AlreadyExists naming %s", what, err, name)
		}
	}

	if err := single("pvc-kind-single"); err != nil {
		t.Fatal(err)
	}
	pvc, err := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace).Get(ctx, "pvc-kind-single", metav1.GetOptions{})
	if err != nil || pvc.Spec.VolumeName == "" {
		t.Fatalf("single-node host PVC: %v, %v; want bound", pvc, err)
	}
	_, err = s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-kind-single", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}, Parameters: map[string]string{"hostStorageClass": kubevirtsim.DefaultStorageClass}})
	expect("RWX under a single-node volume's name", err, "pvc-kind-single")
	if _, err := s.hc.GetNetworkFS(ctx, pvc.Spec.VolumeName); !apierrors.IsNotFound(err) {
		t.Errorf("the single-node volume got a NetworkFilesystem: %v", err)
	}

	vol, _ := s.create(ctx, t, "pvc-kind-shared")
	expect("single-node under an RWX volume's name", single(vol), vol)

	// As the upstream driver leaves it: no annotation, a NetworkFilesystem.
	up, _ := s.create(ctx, t, "pvc-kind-upstream")
	patch := []byte(`{"metadata":{"annotations":{"` + host.AccessModeAnnotation + `":null}}}`)
	if _, err := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace).Patch(ctx, up, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	expect("single-node under an upstream RWX volume's name", single(up), up)
	if again, _ := s.create(ctx, t, "pvc-kind-upstream"); again != up {
		t.Errorf("RWX again under the upstream RWX volume's name answered %s, want %s", again, up)
	}
}

// guestAttachment writes a VolumeAttachment of this driver for the
// volume's guest PV on node, attached or not, as the attach/detach
// controller and the external-attacher would. A finalizer keeps it while
// it is deleted.
func (s *rwxSuite) guestAttachment(ctx context.Context, t *testing.T, vol, node string, attached bool) *storagev1.VolumeAttachment {
	t.Helper()
	pv := vol
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: "csi-" + vol + "-" + node, Finalizers: []string{"external-attacher/driver-harvesterhci-io"}},
		Spec:       storagev1.VolumeAttachmentSpec{Attacher: driver.Name, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv}},
	}
	va, err := s.guest.Kube.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if attached {
		va.Status.Attached = true
		if va, err = s.guest.Kube.StorageV1().VolumeAttachments().UpdateStatus(ctx, va, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return va
}

// removeAttachment deletes a VolumeAttachment and drops its finalizer, as
// the external-attacher does after the unpublish.
func (s *rwxSuite) removeAttachment(ctx context.Context, t *testing.T, name string) {
	t.Helper()
	vas := s.guest.Kube.StorageV1().VolumeAttachments()
	if err := vas.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	if _, err := vas.Patch(ctx, name, types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
}

// guestNode registers a guest Node's CSINode with this driver's node ID,
// the VM it runs on.
func (s *rwxSuite) guestNode(ctx context.Context, t *testing.T, node, vm string) {
	t.Helper()
	cn := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: node},
		Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: driver.Name, NodeID: vm}}}}
	if _, err := s.guest.Kube.StorageV1().CSINodes().Create(ctx, cn, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
}

// attachmentsKeepTheExport: unpublishing one VM while another node's
// VolumeAttachment is attached, and no pod uses the claim, leaves the
// export enabled (kubelet there stages from its attachment without a new
// publish); the VolumeAttachment of the node being unpublished, being
// deleted, does not count; once the other one goes, the export is disabled.
func (s *rwxSuite) attachmentsKeepTheExport(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s.guestNode(ctx, t, "node-a", "vm-a")
	s.guestNode(ctx, t, "node-b", "vm-b")
	vol, pvc := s.create(ctx, t, "pvc-rwx-vas")
	s.guestClaim(ctx, t, vol, "vas")
	for _, vm := range []string{"vm-a", "vm-b"} {
		if _, err := s.publish(ctx, vm, vol); err != nil {
			t.Fatalf("publish to %s: %v", vm, err)
		}
	}
	vaA := s.guestAttachment(ctx, t, vol, "node-a", true)
	vaB := s.guestAttachment(ctx, t, vol, "node-b", true)
	// node-a's pod is gone and its attachment is being deleted: the
	// attach/detach controller unpublishes vm-a.
	if err := s.guest.Kube.StorageV1().VolumeAttachments().Delete(ctx, vaA.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-a"}); err != nil {
		t.Fatalf("unpublish vm-a: %v", err)
	}
	if fs, _ := s.hc.GetNetworkFS(ctx, pvc.Spec.VolumeName); fs.Spec.DesiredState != host.NetworkFSEnabled {
		t.Fatalf("unpublish of vm-a while node-b's VolumeAttachment is attached disabled the export: %s", fs.Describe())
	}
	s.removeAttachment(ctx, t, vaA.Name)
	s.removeAttachment(ctx, t, vaB.Name)
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-b"}); err != nil {
		t.Fatalf("unpublish vm-b: %v", err)
	}
	if fs, _ := s.hc.GetNetworkFS(ctx, pvc.Spec.VolumeName); fs.Spec.DesiredState != host.NetworkFSDisabled {
		t.Fatalf("the last unpublish, with no attachment and no pod left, kept the export: %s", fs.Describe())
	}
}

// publishedNodes: ListVolumes and ControllerGetVolume report an RWX volume
// published to the VMs of its attached VolumeAttachments while its export
// is enabled, and to none when it is not; a publish to a node ID that names
// no VM is NotFound; DeleteVolume while a VolumeAttachment exists is
// FailedPrecondition.
func (s *rwxSuite) publishedNodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s.guestNode(ctx, t, "node-a", "vm-a")
	s.guestNode(ctx, t, "node-b", "vm-b")
	vol, pvc := s.create(ctx, t, "pvc-rwx-list")
	s.guestClaim(ctx, t, vol, "list")

	_, err := s.ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "vm-none", VolumeCapability: rwxMount})
	if status.Code(err) != codes.NotFound || !strings.Contains(status.Convert(err).Message(), "vm-none") || !strings.Contains(status.Convert(err).Message(), vol) {
		t.Errorf("publish to a node ID that names no VM: %v, want NotFound naming vm-none and %s", err, vol)
	}
	if fs, _ := s.hc.GetNetworkFS(ctx, pvc.Spec.VolumeName); fs.Spec.DesiredState != host.NetworkFSDisabled {
		t.Errorf("a publish to no VM enabled the export: %s", fs.Describe())
	}

	for _, vm := range []string{"vm-a", "vm-b"} {
		if _, err := s.publish(ctx, vm, vol); err != nil {
			t.Fatalf("publish to %s: %v", vm, err)
		}
	}
	vaA := s.guestAttachment(ctx, t, vol, "node-a", true)
	vaB := s.guestAttachment(ctx, t, vol, "node-b", false) // still attaching: not published yet
	reported := func() (list, get []string, err error) {
		l, err := s.ctrl.Client.ListVolumes(ctx, &csi.ListVolumesRequest{})
		if err != nil {
			return nil, nil, err
		}
		for _, e := range l.GetEntries() {
			if e.GetVolume().GetVolumeId() == vol {
				list = e.GetStatus().GetPublishedNodeIds()
			}
		}
		g, err := s.ctrl.Client.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: vol})
		return list, g.GetStatus().GetPublishedNodeIds(), err
	}
	waitReported := func(what string, want ...string) {
		t.Helper()
		testwait.Until(ctx, t, what, func() (bool, string) {
			list, get, err := reported()
			return err == nil && slices.Equal(list, want) && slices.Equal(get, want),
				fmt.Sprintf("ListVolumes %v, ControllerGetVolume %v, err %v; want %v", list, get, err, want)
		})
	}
	waitReported("published to vm-a, whose attachment is attached", "vm-a")

	_, err = s.ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), vaA.Name) {
		t.Errorf("delete while published: %v, want FailedPrecondition naming %s", err, vaA.Name)
	}
	if fs, err := s.hc.GetNetworkFS(ctx, pvc.Spec.VolumeName); err != nil || fs.Spec.DesiredState != host.NetworkFSEnabled {
		t.Errorf("delete while published touched the export: %v, %v", fs, err)
	}

	vaB.Status.Attached = true
	if _, err := s.guest.Kube.StorageV1().VolumeAttachments().UpdateStatus(ctx, vaB, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitReported("published to both VMs", "vm-a", "vm-b")

	// The export disabled behind the driver's back: published nowhere, so
	// that the attacher publishes again.
	if _, err := s.hc.SetNetworkFSState(ctx, pvc.Spec.VolumeName, host.NetworkFSDisabled); err != nil {
		t.Fatal(err)
	}
	waitReported("published nowhere while the export is disabled")
	if _, err := s.publish(ctx, "vm-a", vol); err != nil {
		t.Fatalf("publish again: %v", err)
	}
	waitReported("published to both VMs once enabled again", "vm-a", "vm-b")

	s.removeAttachment(ctx, t, vaA.Name)
	s.removeAttachment(ctx, t, vaB.Name)
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol}); err != nil {
		t.Errorf("delete once unpublished: %v", err)
	}
}

func (s *rwxSuite) create(ctx context.Context, t *testing.T, name string) (string, *corev1.PersistentVolumeClaim) {
	t.Helper()
	resp, err := s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}, Parameters: map[string]string{"hostStorageClass": kubevirtsim.DefaultStorageClass}})
	if err != nil {
		t.Fatalf("create RWX volume %s: %v", name, err)
	}
	pvc, err := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace).Get(ctx, resp.Volume.VolumeId, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Volume.VolumeId, pvc
}

func (s *rwxSuite) publish(ctx context.Context, vm, vol string) (*csi.ControllerPublishVolumeResponse, error) {
	var resp *csi.ControllerPublishVolumeResponse
	err := newAttacher(func() csi.ControllerClient { return s.ctrl.Client }).do(ctx, func(ctx context.Context, c csi.ControllerClient) error {
		var err error
		resp, err = c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: vm, VolumeCapability: rwxMount})
		return err
	})
	return resp, err
}

// guestClaim writes the guest side of a volume as the provisioner and a
// user would: the PV of the volume bound to default/<claim>.
func (s *rwxSuite) guestClaim(ctx context.Context, t *testing.T, vol, claim string) {
	t.Helper()
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: vol},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:               corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			ClaimRef:               &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "default", Name: claim},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver.Name, VolumeHandle: vol}},
		},
	}
	if _, err := s.guest.Kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func guestPod(ctx context.Context, t *testing.T, kube kubernetes.Interface, name, node, claim string) {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "app", Image: "busybox"}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}}},
	}
	if _, err := kube.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (s *rwxSuite) lifecycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vol, pvc := s.create(ctx, t, "pvc-rwx-life")
	if pvc.Spec.VolumeMode == nil || *pvc.Spec.VolumeMode != corev1.PersistentVolumeFilesystem || pvc.Spec.VolumeName == "" {
		t.Fatalf("host PVC %s: mode %v, volume %q; want Filesystem and bound", vol, pvc.Spec.VolumeMode, pvc.Spec.VolumeName)
	}
	fsName := pvc.Spec.VolumeName
	fs, err := s.hc.GetNetworkFS(ctx, fsName)
	if err != nil {
		t.Fatalf("NetworkFilesystem of %s: %v", vol, err)
	}
	if fs.Spec.DesiredState != host.NetworkFSDisabled || fs.Spec.NetworkFSName != fsName || fs.Spec.Provisioner != host.NetworkFSProvisioner {
		t.Fatalf("NetworkFilesystem spec %+v, want Disabled, exporting %s, provisioner Longhorn", fs.Spec, fsName)
	}
	// The provisioner retries: the same request is the same volume.
	if again, _ := s.create(ctx, t, "pvc-rwx-life"); again != vol {
		t.Fatalf("repeated create answered %s, want %s", again, vol)
	}

	var contexts []map[string]string
	for _, vm := range []string{"vm-a", "vm-b"} {
		resp, err := s.publish(ctx, vm, vol)
		if err != nil {
			t.Fatalf("publish to %s: %v", vm, err)
		}
		contexts = append(contexts, resp.GetPublishContext())
	}
	for i, pc := range contexts {
		if pc["nfsEndpoint"] != kubevirtsim.DefaultNFSEndpoint || pc["nfsExport"] != "/"+fsName {
			t.Errorf("publish %d context %v, want endpoint %s export /%s", i, pc, kubevirtsim.DefaultNFSEndpoint, fsName)
		}
	}
	if fs, _ = s.hc.GetNetworkFS(ctx, fsName); !fs.Serving() {
		t.Errorf("after publish: %s, want serving", fs.Describe())
	}
	// Nothing was hot-plugged.
	for _, vm := range []string{"vm-a", "vm-b"} {
		if got := s.ctrl.Queue.Holders(vol); len(got) > 0 {
			t.Errorf("RWX volume hot-plugged into %v", got)
		}
		vmObj, _ := s.host.Sim.VM(s.host.Namespace, vm)
		for _, v := range vmObj.Spec.Template.Spec.Volumes {
			if v.Name == vol {
				t.Errorf("VM %s has the RWX volume in its spec", vm)
			}
		}
	}
	// A repeated publish is answered from the serving export.
	if _, err := s.ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "vm-a", VolumeCapability: rwxMount}); err != nil {
		t.Errorf("repeated publish: %v", err)
	}

	// A pod on vm-b's node still uses the claim: unpublishing vm-a leaves
	// the export enabled.
	s.guestClaim(ctx, t, vol, "shared")
	guestPod(ctx, t, s.guest.Kube, "app-b", "node-b", "shared")
	s.waitUsers(t, vol, true)
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-a"}); err != nil {
		t.Fatalf("unpublish vm-a: %v", err)
	}
	if fs, _ = s.hc.GetNetworkFS(ctx, fsName); fs.Spec.DesiredState != host.NetworkFSEnabled {
		t.Fatalf("unpublish with a pod still using the claim disabled the export: %s", fs.Describe())
	}
	// The last user goes: the next unpublish disables it.
	if err := s.guest.Kube.CoreV1().Pods("default").Delete(ctx, "app-b", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	s.waitUsers(t, vol, false)
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-b"}); err != nil {
		t.Fatalf("unpublish vm-b: %v", err)
	}
	fs, err = s.hc.WaitNetworkFS(ctx, fsName, func(n *host.NetworkFS) bool { return n.Status.State == host.NetworkFSDisabled })
	if err != nil || fs.Spec.DesiredState != host.NetworkFSDisabled || fs.Status.Endpoint != "" {
		t.Fatalf("after the last unpublish: %v, %v; want disabled", fs, err)
	}
	// Repeated: still OK, nothing changes.
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-b"}); err != nil {
		t.Errorf("repeated unpublish: %v", err)
	}
	// Published again after being disabled: enabled again.
	if _, err := s.publish(ctx, "vm-a", vol); err != nil {
		t.Fatalf("publish after disable: %v", err)
	}
	if _, err := s.ctrl.Client.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm-a"}); err != nil {
		t.Fatal(err)
	}

	// Delete: the NetworkFilesystem first, then the host PVC; twice is fine.
	for range 2 {
		if _, err := s.ctrl.Client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol}); err != nil {
			t.Fatalf("delete: %v", err)
		}
	}
	if _, err := s.hc.GetNetworkFS(ctx, fsName); !apierrors.IsNotFound(err) {
		t.Errorf("NetworkFilesystem after delete: %v, want NotFound", err)
	}
	if p, err := s.host.Kube.CoreV1().PersistentVolumeClaims(s.host.Namespace).Get(ctx, vol, metav1.GetOptions{}); err == nil && p.DeletionTimestamp == nil {
		t.Errorf("host PVC %s still there after delete", vol)
	}
}

// waitUsers waits until the controller's guest pod cache agrees that the
// volume is used (or not), as the attacher's retries would.
func (s *rwxSuite) waitUsers(t *testing.T, vol string, used bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	testwait.Until(ctx, t, fmt.Sprintf("the guest pod cache to say used=%t", used), func() (bool, string) {
		users, err := s.ctrl.Driver.ClaimUsers(ctx, vol)
		return err == nil && (len(users) > 0) == used, fmt.Sprintf("users %v, err %v", users, err)
	})
}

func (s *rwxSuite) badInput(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	expect := func(what string, err error, want codes.Code, mentions string) {
		t.Helper()
		if status.Code(err) != want || !strings.Contains(status.Convert(err).Message(), mentions) {
			t.Errorf("%s: %v, want %s naming %q", what, err, want, mentions)
		}
	}
	_, err := s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-block",
		VolumeCapabilities: []*csi.VolumeCapability{rwxCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, true)}})
	expect("block RWX", err, codes.InvalidArgument, "block")
	_, err = s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-snap", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "snap-1"}}}})
	expect("RWX from a snapshot", err, codes.InvalidArgument, "pvc-rwx-snap")

	other := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "not-longhorn"}, Provisioner: "other.csi.example.com"}
	if _, err := s.host.Kube.StorageV1().StorageClasses().Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-other", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		Parameters: map[string]string{"hostStorageClass": "not-longhorn"}})
	expect("RWX on a class that is not Longhorn", err, codes.InvalidArgument, "not-longhorn")
	_, err = s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-nope", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		Parameters: map[string]string{"hostStorageClass": "nope"}})
	expect("RWX on a missing class", err, codes.InvalidArgument, "nope")

	vol, _ := s.create(ctx, t, "pvc-rwx-size")
	_, err = s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwx-size", VolumeCapabilities: []*csi.VolumeCapability{rwxMount},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}})
	expect("same name, other size", err, codes.AlreadyExists, vol)
	_, err = s.ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-rwx-missing", NodeId: "vm-a", VolumeCapability: rwxMount})
	expect("publish of a missing volume", err, codes.NotFound, "pvc-rwx-missing")
	_, err = s.ctrl.Client.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}, VolumeCapability: rwxMount})
	expect("expand RWX", err, codes.InvalidArgument, vol)

	// A single-node (block) volume is not confirmed as ReadWriteMany, and
	// cannot be published so.
	rwo, err := s.ctrl.Client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-rwo-block",
		VolumeCapabilities: []*csi.VolumeCapability{rwxCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, true)}})
	if err != nil {
		t.Fatal(err)
	}
	id := rwo.Volume.VolumeId
	v, err := s.ctrl.Client.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{rwxMount}})
	if err != nil || v.GetConfirmed() != nil || !strings.Contains(v.GetMessage(), id) {
		t.Errorf("validate RWX on a block volume: %v, %v; want unconfirmed with a message naming it", v, err)
	}
	bound, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	testwait.Until(bound, t, "the block volume's claim to be bound", func() (bool, string) {
		_, err = s.ctrl.Client.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "vm-a", VolumeCapability: rwxMount})
		return status.Code(err) != codes.Aborted, fmt.Sprint(err) // Aborted: not bound yet
	})
	expect("RWX publish of a block volume", err, codes.FailedPrecondition, id)
}
