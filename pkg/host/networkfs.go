package host

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/util/retry"
)

// Harvester's networkfs-manager exports a Longhorn RWX volume over NFS when
// the volume's NetworkFilesystem (group harvesterhci.io, v1beta1, namespaced,
// always in harvester-system and named after the Longhorn volume, which is
// the host PV's name) asks for it. Its Go types are not on the module proxy;
// the few fields the driver uses are declared here, with the JSON names of
// the CRD (manifests/crds/harvesterhci.io_networkfilesystems.yaml there).
var NetworkFSResource = schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "networkfilesystems"}

const (
	// NetworkFSNamespace is where networkfs-manager looks for them.
	NetworkFSNamespace = "harvester-system"
	// NetworkFSProvisioner is upstream's spec.provisioner for Longhorn.
	NetworkFSProvisioner = "Longhorn"
	// LonghornProvisioner is the host CSI driver that RWX volumes need:
	// only Longhorn volumes have a share manager to export.
	LonghornProvisioner = "driver.longhorn.io"
)

// States of spec.desiredState and status.state.
const (
	NetworkFSEnabled   = "Enabled"
	NetworkFSEnabling  = "Enabling"
	NetworkFSDisabling = "Disabling"
	NetworkFSDisabled  = "Disabled"
)

// EndpointReady is status.status once the endpoint serves.
const EndpointReady = "Ready"

// NetworkFS is the part of a NetworkFilesystem the driver reads and writes.
type NetworkFS struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              NetworkFSSpec   `json:"spec"`
	Status            NetworkFSStatus `json:"status,omitempty"`
}

// NetworkFSSpec: networkFSName and desiredState are required by the CRD.
type NetworkFSSpec struct {
	NetworkFSName string `json:"networkFSName"`
	DesiredState  string `json:"desiredState"`
	Provisioner   string `json:"provisioner,omitempty"`
}

// NetworkFSStatus is written by networkfs-manager only.
type NetworkFSStatus struct {
	// Endpoint is the NFS server's address (an IP), empty until exported.
	Endpoint string `json:"endpoint,omitempty"`
	// State is Enabled, Enabling, Disabling, Disabled or Unknown.
	State string `json:"state,omitempty"`
	// Status is the endpoint's: Ready, NotReady, Reconciling, ...
	Status string `json:"status,omitempty"`
	// MountOpts are the mount options networkfs-manager recommends (the
	// Longhorn class's nfsOptions), comma separated; may be empty.
	MountOpts string `json:"mountOpts,omitempty"`
	// Type is the protocol, NFS.
	Type string `json:"type,omitempty"`
}

// Serving reports whether the export can be mounted now.
func (n *NetworkFS) Serving() bool {
	return n.Spec.DesiredState == NetworkFSEnabled && n.Status.State == NetworkFSEnabled && n.Status.Endpoint != "" &&
		(n.Status.Status == "" || n.Status.Status == EndpointReady)
}

// Describe says where the object is, for errors and logs.
func (n *NetworkFS) Describe() string {
	return fmt.Sprintf("NetworkFilesystem %s/%s (desired %s, state %q, endpoint %q, status %q)",
		NetworkFSNamespace, n.Name, n.Spec.DesiredState, n.Status.State, n.Status.Endpoint, n.Status.Status)
}

func networkFSFrom(u *unstructured.Unstructured) (*NetworkFS, error) {
	n := &NetworkFS{}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, n); err != nil {
		return nil, fmt.Errorf("NetworkFilesystem %s: %w", u.GetName(), err)
	}
	return n, nil
}

// NetworkFSAvailable lists NetworkFilesystems once, as upstream does at
// start-up to decide whether RWX volumes are offered: nil means the CRD is
// served and readable.
func (c *Client) NetworkFSAvailable(ctx context.Context) error {
	_, err := c.Dynamic.Resource(NetworkFSResource).Namespace(NetworkFSNamespace).List(ctx, metav1.ListOptions{Limit: 1})
	return err
}

// GetNetworkFS reads a NetworkFilesystem.
func (c *Client) GetNetworkFS(ctx context.Context, name string) (*NetworkFS, error) {
	u, err := c.Dynamic.Resource(NetworkFSResource).Namespace(NetworkFSNamespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return networkFSFrom(u)
}

// CreateNetworkFS creates the NetworkFilesystem of a Longhorn volume with the
// given desired state, or returns the existing one (networkfs-manager, or an
// earlier call, may have made it). An existing one for another volume is an
// error: the name is the volume's.
func (c *Client) CreateNetworkFS(ctx context.Context, name, desired string) (*NetworkFS, error) {
	want := &NetworkFS{
		TypeMeta:   metav1.TypeMeta{APIVersion: NetworkFSResource.GroupVersion().String(), Kind: "NetworkFilesystem"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: NetworkFSNamespace, Labels: map[string]string{VolumeLabel: VolumeLabelValue}},
		Spec:       NetworkFSSpec{NetworkFSName: name, DesiredState: desired, Provisioner: NetworkFSProvisioner},
	}
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(want)
	if err != nil {
		return nil, err
	}
	delete(obj, "status")
	res := c.Dynamic.Resource(NetworkFSResource).Namespace(NetworkFSNamespace)
	created, err := res.Create(ctx, &unstructured.Unstructured{Object: obj}, metav1.CreateOptions{})
	if err == nil {
		return networkFSFrom(created)
	}
	if !apierrors.IsAlreadyExists(err) {
		return nil, err
	}
	existing, err := c.GetNetworkFS(ctx, name)
	if err != nil {
		return nil, err
	}
	if existing.Spec.NetworkFSName != "" && existing.Spec.NetworkFSName != name {
		return nil, &NetworkFSMismatchError{Name: name, Exports: existing.Spec.NetworkFSName}
	}
	return existing, nil
}

// NetworkFSMismatchError reports a NetworkFilesystem of the volume's name
// that exports another volume.
type NetworkFSMismatchError struct{ Name, Exports string }

func (e *NetworkFSMismatchError) Error() string {
	return fmt.Sprintf("NetworkFilesystem %s/%s already exists and exports %q, not the volume %s", NetworkFSNamespace, e.Name, e.Exports, e.Name)
}

// SetNetworkFSState sets spec.desiredState (retrying on conflicts) and
// returns the object as written; an object already in that desired state is
// returned unchanged.
func (c *Client) SetNetworkFSState(ctx context.Context, name, desired string) (*NetworkFS, error) {
	res := c.Dynamic.Resource(NetworkFSResource).Namespace(NetworkFSNamespace)
	var out *NetworkFS
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		u, err := res.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if cur, _, _ := unstructured.NestedString(u.Object, "spec", "desiredState"); cur == desired {
			out, err = networkFSFrom(u)
			return err
		}
		if err := unstructured.SetNestedField(u.Object, desired, "spec", "desiredState"); err != nil {
			return err
		}
		updated, err := res.Update(ctx, u, metav1.UpdateOptions{})
		if err != nil {
			return err
		}
		out, err = networkFSFrom(updated)
		return err
	})
	return out, err
}

// DeleteNetworkFS deletes a NetworkFilesystem; a missing one is not an error.
func (c *Client) DeleteNetworkFS(ctx context.Context, name string) error {
	return c.deleteObject(ctx, NetworkFSResource, NetworkFSNamespace, name)
}

// WaitNetworkFS watches a NetworkFilesystem until done says so or ctx ends,
// and returns its last state either way (nil if it was never read).
func (c *Client) WaitNetworkFS(ctx context.Context, name string, done func(*NetworkFS) bool) (*NetworkFS, error) {
	res := c.Dynamic.Resource(NetworkFSResource).Namespace(NetworkFSNamespace)
	for {
		u, err := res.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, err
		}
		n, err := networkFSFrom(u)
		if err != nil || done(n) {
			return n, err
		}
		w, err := res.Watch(ctx, metav1.ListOptions{
			FieldSelector:   fields.OneTermEqualSelector("metadata.name", name).String(),
			ResourceVersion: u.GetResourceVersion(),
		})
		if err != nil {
			return n, err
		}
		n, finished, err := watchNetworkFS(ctx, w.ResultChan(), n, done)
		w.Stop()
		if finished || err != nil {
			return n, err
		}
		// The watch ended (the server closes them now and then): look again.
	}
}

func watchNetworkFS(ctx context.Context, events <-chan watch.Event, last *NetworkFS, done func(*NetworkFS) bool) (*NetworkFS, bool, error) {
	for {
		select {
		case <-ctx.Done():
			return last, false, ctx.Err()
		case ev, ok := <-events:
			if !ok {
				return last, false, nil
			}
			u, isObj := ev.Object.(*unstructured.Unstructured)
			if !isObj {
				continue
			}
			if ev.Type == watch.Deleted {
				return last, false, apierrors.NewNotFound(NetworkFSResource.GroupResource(), u.GetName())
			}
			n, err := networkFSFrom(u)
			if err != nil {
				return last, false, err
			}
			if done(n) {
				return n, true, nil
			}
			last = n
		}
	}
}

// NFSExport returns where a volume's NFS export is served now: the
// NetworkFilesystem of its host PVC's Longhorn volume, which must be serving.
func (c *Client) NFSExport(ctx context.Context, volume string) (endpoint, export, mountOpts string, err error) {
	pvc, err := c.GetVolume(ctx, volume)
	if err != nil {
		return "", "", "", err
	}
	if pvc.Spec.VolumeName == "" {
		return "", "", "", fmt.Errorf("host PVC %s has no Longhorn volume", volume)
	}
	n, err := c.GetNetworkFS(ctx, pvc.Spec.VolumeName)
	if err != nil {
		return "", "", "", err
	}
	if !n.Serving() {
		return "", "", "", fmt.Errorf("%s is not serving", n.Describe())
	}
	return n.Status.Endpoint, "/" + n.Name, n.Status.MountOpts, nil
}

// StorageClassProvisioner returns the provisioner of a host class. known is
// false when the class is not named (the host's default: its PVC will say)
// or the guest may not read classes; upstream then assumes Longhorn.
func (c *Client) StorageClassProvisioner(ctx context.Context, name string) (provisioner string, known bool, err error) {
	if name == "" {
		return "", false, nil
	}
	sc, err := c.Kube.StorageV1().StorageClasses().Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsForbidden(err):
		return "", false, nil
	case err != nil:
		return "", false, err
	}
	return sc.Provisioner, true, nil
}

// ListNetworkFS lists the NetworkFilesystems (all of networkfs-manager's
// namespace: one per Longhorn volume).
func (c *Client) ListNetworkFS(ctx context.Context) ([]NetworkFS, error) {
	list, err := c.Dynamic.Resource(NetworkFSResource).Namespace(NetworkFSNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	out := make([]NetworkFS, 0, len(list.Items))
	for i := range list.Items {
		n, err := networkFSFrom(&list.Items[i])
		if err != nil {
			return nil, err
		}
		out = append(out, *n)
	}
	return out, nil
}
